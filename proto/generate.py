"""Regenerate services/rpc/ from proto/dsaserve.proto.

Run from anywhere: `python proto/generate.py [--out DIR]`. tests/services/test_proto.py generates
into a temporary folder and fails if the committed stubs differ, so the wire contract and
the code that speaks it never drift apart.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys

from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "dsaserve" / "services" / "rpc"


def generate(out: pathlib.Path) -> int:
    rc = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{ROOT / 'proto'}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            str(ROOT / "proto" / "dsaserve.proto"),
        ]
    )
    if rc != 0:
        return rc
    # protoc writes `import dsaserve_pb2`, which only works with services/rpc on sys.path.
    grpc_file = out / "dsaserve_pb2_grpc.py"
    text = grpc_file.read_text()
    grpc_file.write_text(
        re.sub(r"^import dsaserve_pb2 as", "from . import dsaserve_pb2 as", text, flags=re.M)
    )
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=OUT)
    sys.exit(generate(parser.parse_args().out))
