"""The committed gRPC stubs are exactly what proto/dsaserve.proto generates."""

from __future__ import annotations

import subprocess
import sys

from tests import REPO_ROOT

GENERATED = ("dsaserve_pb2.py", "dsaserve_pb2.pyi", "dsaserve_pb2_grpc.py")


def test_generated_stubs_match_the_proto(tmp_path):
    subprocess.run(
        [sys.executable, str(REPO_ROOT / "proto" / "generate.py"), "--out", str(tmp_path)],
        check=True,
    )
    for name in GENERATED:
        fresh, committed = (
            (tmp_path / name).read_text(),
            (REPO_ROOT / "dsaserve" / "services" / "rpc" / name).read_text(),
        )
        assert fresh == committed, (
            f"dsaserve/services/rpc/{name} is stale: run `python proto/generate.py` and commit"
        )
