"""Regenerate services/rpc/ from proto/dsaserve.proto.

Run from anywhere: `python proto/generate.py`. CI runs it and fails if the committed
stubs differ, so the wire contract and the code that speaks it never drift apart.
"""

from __future__ import annotations

import pathlib
import re
import sys

from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "services" / "rpc"


def main() -> int:
    rc = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{ROOT / 'proto'}",
            f"--python_out={OUT}",
            f"--pyi_out={OUT}",
            f"--grpc_python_out={OUT}",
            str(ROOT / "proto" / "dsaserve.proto"),
        ]
    )
    if rc != 0:
        return rc
    # protoc writes `import dsaserve_pb2`, which only works with services/rpc on sys.path.
    grpc_file = OUT / "dsaserve_pb2_grpc.py"
    text = grpc_file.read_text()
    grpc_file.write_text(re.sub(r"^import dsaserve_pb2 as", "from . import dsaserve_pb2 as", text, flags=re.M))
    return 0


if __name__ == "__main__":
    sys.exit(main())
