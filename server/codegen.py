"""Regenerate the committed gRPC modules from infer.proto: ``python -m infer.server.codegen`` (needs grpcio-tools).

protoc names a module after the proto's path, so the proto is compiled as ``infer/server/infer.proto`` and the
generated service module imports ``from infer.server import infer_pb2``.
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

PROTO = Path(__file__).with_name("infer.proto")
GENERATED = ("infer_pb2.py", "infer_pb2.pyi", "infer_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    """Compile infer.proto and write the generated modules to ``out_dir``; return their paths."""
    from importlib import resources

    from grpc_tools import protoc

    include = resources.files("grpc_tools") / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "infer" / "server"
        src.mkdir(parents=True)
        shutil.copyfile(PROTO, src / "infer.proto")
        args = ["protoc", f"-I{tmp}", f"-I{include}", f"--python_out={tmp}", f"--pyi_out={tmp}",
                f"--grpc_python_out={tmp}", "infer/server/infer.proto"]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {PROTO}")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for name in GENERATED:
            target = out_dir / name
            shutil.copyfile(src / name, target)
            written.append(target)
    return written


def main() -> None:
    for path in generate(PROTO.parent):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
