"""Generates the gRPC stubs (hsx/v1/) from the repository's proto/ when the
package is built; they are never committed."""

from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent
PROTO_ROOT = HERE.parent.parent / "proto"
PROTO = PROTO_ROOT / "hsx" / "v1" / "hsx.proto"


def generate_stubs():
    from grpc_tools import protoc

    (HERE / "hsx" / "v1").mkdir(parents=True, exist_ok=True)
    (HERE / "hsx" / "v1" / "__init__.py").write_text('"""Generated gRPC stubs for hsx.v1."""\n')
    rc = protoc.main(["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"--python_out={HERE}",
                      f"--grpc_python_out={HERE}", str(PROTO)])
    if rc != 0:
        raise RuntimeError(f"protoc failed on {PROTO}")


if PROTO.exists():  # building from the repository (an sdist carries the stubs)
    generate_stubs()

setup()
