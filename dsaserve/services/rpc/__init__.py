"""Generated gRPC stubs for proto/dsaserve.proto (do not edit; run `python proto/generate.py`)."""

from . import dsaserve_pb2 as pb
from . import dsaserve_pb2_grpc as grpc_api

__all__ = ["pb", "grpc_api"]
