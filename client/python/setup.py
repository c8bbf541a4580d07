"""Generates the gRPC stubs (hsx/v1/) from the repository's proto/ when the
package is built; they are never committed. Adds the native receive path
(hsx/_native*.so, built by CMake from client/python/native/) when
HSX_NATIVE_MODULE names it, as scripts/setup.sh does; without it the package
is pure Python and receives streams with grpcio."""

import os
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

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

class BuildPyWithNative(build_py):
    """build_py, plus the prebuilt native module (copied into the build, never into the sources)."""

    def run(self):
        super().run()
        native = os.environ.get("HSX_NATIVE_MODULE")
        if native:
            module = Path(native)
            if not module.is_file() or not module.name.startswith("_native."):
                raise RuntimeError(f"HSX_NATIVE_MODULE={native}: not a built hsx._native module")
            self.copy_file(str(module), str(Path(self.build_lib) / "hsx" / module.name))


setup(cmdclass={"build_py": BuildPyWithNative})
