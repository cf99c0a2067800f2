#!/usr/bin/env python3
"""Builds an OCI image layout for sluice in the form Istio pulls for a
WasmPlugin `url: oci://...`: the Wasm "compat" variant, i.e. an ordinary
OCI image with a single layer of media type
application/vnd.oci.image.layer.v1.tar+gzip holding `plugin.wasm`
(istio/istio pkg/wasm/imagefetcher.go: extractOCIStandardImage; the layer
must be gzip-compressed, and the file is found by its base name). The
manifest carries the annotation `module.wasm.image/variant: compat`, which
the Wasm image spec's compat variant requires of an image whose layer has
the OCI tar+gzip media type.

The default tag is the crate version and the commit, `0.1.0-<short sha>`,
with `-dirty` when tracked files have uncommitted changes (as `git describe
--dirty`), or the version alone outside a git work tree: every build of a
new commit gets a new tag, which a WasmPlugin's `imagePullPolicy:
IfNotPresent` would otherwise never fetch.

Standard library only, no Docker engine. Reproducible: fixed timestamps,
owners and modes, gzip without a name or time, so the same .wasm always
gives the same digests.

    scripts/oci.py [--wasm target/wasm32-wasip1/release/sluice.wasm]
                   [--out target/oci] [--tag 0.1.0-1a2b3c4]

Then push it with any OCI tool, under the tag it printed, e.g.
    skopeo copy oci:target/oci:TAG docker://registry.example.com/sluice:TAG
    oras cp --from-oci-layout target/oci:TAG registry.example.com/sluice:TAG
"""

import argparse
import gzip
import hashlib
import io
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
CONFIG_TYPE = "application/vnd.oci.image.config.v1+json"
LAYER_TYPE = "application/vnd.oci.image.layer.v1.tar+gzip"
# The Wasm image spec, compat variant: "If the media type equals
# application/vnd.oci.image.layer.v1.tar+gzip, then a compat variant image
# must add the annotation module.wasm.image/variant=compat in the manifest."
VARIANT_ANNOTATION = ("module.wasm.image/variant", "compat")
EPOCH = 0  # 1970-01-01T00:00:00Z: fixed, for reproducible digests
CREATED = "1970-01-01T00:00:00Z"


def version():
    for line in (ROOT / "Cargo.toml").read_text().splitlines():
        if line.startswith("version"):
            return line.split("=", 1)[1].strip().strip('"')
    return "latest"


def git(*args):
    """Output of a git command in the project, or None (no git, not a work tree)."""
    try:
        p = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return p.stdout.strip() if p.returncode == 0 else None


def default_tag():
    """`<version>-<short sha>[-dirty]`; the version alone outside git."""
    sha = git("rev-parse", "--short", "HEAD")
    if not sha:
        return version()
    # Tracked files only, as `git describe --dirty`: build output and other
    # untracked files do not make a tree dirty.
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return f"{version()}-{sha}" + ("-dirty" if dirty else "")


def layer_tar(wasm: bytes) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        info = tarfile.TarInfo("plugin.wasm")
        info.size = len(wasm)
        info.mtime = EPOCH
        info.mode = 0o644
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        tar.addfile(info, io.BytesIO(wasm))
    return buf.getvalue()


def gz(data: bytes) -> bytes:
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=EPOCH, compresslevel=9) as f:
        f.write(data)
    return buf.getvalue()


def canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def build(wasm_path: Path, out: Path, tag: str) -> dict:
    wasm = wasm_path.read_bytes()
    if wasm[:4] != b"\0asm":
        raise SystemExit(f"{wasm_path} is not a wasm module")
    tar = layer_tar(wasm)
    layer = gz(tar)
    config = canonical({
        "created": CREATED,
        # Go's GOOS/GOARCH for WASI, as the OCI image spec recommends.
        "architecture": "wasm",
        "os": "wasip1",
        "config": {"Labels": {"org.opencontainers.image.title": "sluice"}},
        "rootfs": {"type": "layers", "diff_ids": [digest(tar)]},
        "history": [{"created": CREATED, "created_by": "scripts/oci.py: plugin.wasm"}],
    })
    manifest = canonical({
        "schemaVersion": 2,
        "mediaType": MANIFEST_TYPE,
        "config": {"mediaType": CONFIG_TYPE, "digest": digest(config), "size": len(config)},
        "layers": [{
            "mediaType": LAYER_TYPE,
            "digest": digest(layer),
            "size": len(layer),
            "annotations": {"org.opencontainers.image.title": "plugin.wasm"},
        }],
        "annotations": {
            "org.opencontainers.image.title": "sluice",
            "org.opencontainers.image.version": tag,
            "org.opencontainers.image.created": CREATED,
            VARIANT_ANNOTATION[0]: VARIANT_ANNOTATION[1],
        },
    })
    index = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{
            "mediaType": MANIFEST_TYPE,
            "digest": digest(manifest),
            "size": len(manifest),
            "annotations": {"org.opencontainers.image.ref.name": tag},
        }],
    }
    if out.exists():
        shutil.rmtree(out)
    blobs = out / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    for blob in (layer, config, manifest):
        (blobs / digest(blob).split(":", 1)[1]).write_bytes(blob)
    (out / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
    (out / "index.json").write_text(json.dumps(index, indent=2) + "\n")
    return {"manifest": digest(manifest), "layer": digest(layer), "config": digest(config),
            "wasm_sha256": hashlib.sha256(wasm).hexdigest()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wasm", type=Path, default=ROOT / "target/wasm32-wasip1/release/sluice.wasm")
    ap.add_argument("--out", type=Path, default=ROOT / "target/oci")
    ap.add_argument("--tag", default=None, help="default: <crate version>-<short commit>[-dirty]")
    a = ap.parse_args(argv)
    a.tag = a.tag or default_tag()
    d = build(a.wasm, a.out, a.tag)
    print(f"OCI image layout: {a.out} (tag {a.tag})")
    print(f"  manifest {d['manifest']}   <- WasmPlugin `sha256` for an oci:// url (without `sha256:`),")
    print(f"                                or pin the url: oci://<registry>/sluice@{d['manifest']}")
    print(f"  layer    {d['layer']} ({LAYER_TYPE}, plugin.wasm)")
    print(f"  plugin.wasm sha256 {d['wasm_sha256']}")
    print(f"Push: skopeo copy oci:{a.out}:{a.tag} docker://<registry>/sluice:{a.tag}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
