"""`scripts/oci.py` (behind `make oci`) builds an OCI image layout Istio can
pull for a WasmPlugin: checked blob by blob, digest by digest, and read the
way Istio's fetcher reads the Wasm "compat" variant."""

import gzip
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from harness import ENVOY, ROOT, WASM, next_base_id

MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
CONFIG_TYPE = "application/vnd.oci.image.config.v1+json"
LAYER_TYPE = "application/vnd.oci.image.layer.v1.tar+gzip"


def build(out, tag="9.9.9"):
    p = subprocess.run([sys.executable, str(ROOT / "scripts/oci.py"), "--wasm", str(WASM), "--out", str(out),
                        "--tag", tag], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def blob(layout, desc):
    algo, hexd = desc["digest"].split(":")
    assert algo == "sha256"
    data = (layout / "blobs" / "sha256" / hexd).read_bytes()
    assert hashlib.sha256(data).hexdigest() == hexd, f"blob {hexd} does not match its digest"
    assert len(data) == desc["size"], f"blob {hexd}: size {len(data)} != descriptor {desc['size']}"
    return data


@pytest.fixture(scope="module")
def layout(tmp_path_factory):
    out = tmp_path_factory.mktemp("oci") / "layout"
    stdout = build(out)
    return out, stdout


def test_layout_files(layout):
    out, _ = layout
    assert json.loads((out / "oci-layout").read_text()) == {"imageLayoutVersion": "1.0.0"}
    index = json.loads((out / "index.json").read_text())
    assert index["schemaVersion"] == 2
    assert len(index["manifests"]) == 1
    desc = index["manifests"][0]
    assert desc["mediaType"] == MANIFEST_TYPE
    assert desc["annotations"]["org.opencontainers.image.ref.name"] == "9.9.9"
    # Exactly the three blobs the manifest chain references, nothing else.
    manifest = json.loads(blob(out, desc))
    referenced = {d["digest"].split(":")[1] for d in [desc, manifest["config"], *manifest["layers"]]}
    assert {p.name for p in (out / "blobs/sha256").iterdir()} == referenced


def test_manifest_config_and_layer(layout):
    out, stdout = layout
    index = json.loads((out / "index.json").read_text())
    mdesc = index["manifests"][0]
    manifest = json.loads(blob(out, mdesc))
    assert manifest["schemaVersion"] == 2
    assert manifest["mediaType"] == MANIFEST_TYPE
    assert manifest["config"]["mediaType"] == CONFIG_TYPE
    assert [lyr["mediaType"] for lyr in manifest["layers"]] == [LAYER_TYPE]
    # The Wasm image spec's compat variant: with an OCI tar+gzip layer, the
    # manifest itself must carry this annotation.
    assert manifest["annotations"]["module.wasm.image/variant"] == "compat"
    assert manifest["annotations"]["org.opencontainers.image.version"] == "9.9.9"

    layer = blob(out, manifest["layers"][0])
    tar_bytes = gzip.decompress(layer)
    config = json.loads(blob(out, manifest["config"]))
    assert config["rootfs"] == {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(tar_bytes).hexdigest()]}
    assert config["os"] and config["architecture"]

    with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as tar:
        members = tar.getmembers()
        assert [m.name for m in members] == ["plugin.wasm"]
        assert members[0].isfile()
        assert tar.extractfile(members[0]).read() == WASM.read_bytes()

    # The script prints the manifest digest: what WasmPlugin `sha256` (or an
    # @sha256 url) must name for an oci:// image.
    assert mdesc["digest"] in stdout


def test_istio_compat_extraction(layout):
    """What Istio's fetcher does for a non-Docker manifest: take the last
    layer, require the OCI tar+gzip media type, gunzip, untar, and return the
    first entry whose base name is plugin.wasm."""
    out, _ = layout
    index = json.loads((out / "index.json").read_text())
    manifest = json.loads(blob(out, index["manifests"][0]))
    last = manifest["layers"][-1]
    assert last["mediaType"] == LAYER_TYPE
    with tarfile.open(fileobj=io.BytesIO(blob(out, last)), mode="r:gz") as tar:
        found = next(tar.extractfile(m).read() for m in tar if Path(m.name).name == "plugin.wasm")
    assert found[:4] == b"\0asm"
    assert found == WASM.read_bytes()


def test_reproducible(tmp_path, layout):
    out, _ = layout
    again = tmp_path / "again"
    build(again)
    files = sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    for f in files:
        assert (out / f).read_bytes() == (again / f).read_bytes(), f


# --- the default tag: version and commit ---

def git(cwd, *args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env["GIT_CEILING_DIRECTORIES"] = str(Path(cwd).parent)
    p = subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    return p.stdout.strip()


def default_tag_in(project, out):
    """Runs a copy of scripts/oci.py in `project` without --tag; returns the
    tag it wrote into the layout (index ref name and manifest annotation)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env["GIT_CEILING_DIRECTORIES"] = str(project.parent)
    p = subprocess.run([sys.executable, str(project / "scripts/oci.py"), "--wasm", str(WASM), "--out", str(out)],
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    desc = json.loads((out / "index.json").read_text())["manifests"][0]
    tag = desc["annotations"]["org.opencontainers.image.ref.name"]
    manifest = json.loads(blob(out, desc))
    assert manifest["annotations"]["org.opencontainers.image.version"] == tag
    assert f"(tag {tag})" in p.stdout
    return tag


def test_default_tag_is_version_and_commit(tmp_path):
    project = tmp_path / "project"
    (project / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts/oci.py", project / "scripts/oci.py")
    (project / "Cargo.toml").write_text('[package]\nname = "sluice"\nversion = "3.4.5"\n')

    # Outside git: the version alone.
    assert default_tag_in(project, tmp_path / "a") == "3.4.5"

    git(project, "init", "-q")
    git(project, "add", "Cargo.toml", "scripts/oci.py")
    git(project, "commit", "-q", "-m", "one")
    sha = git(project, "rev-parse", "--short", "HEAD")
    assert re.fullmatch(r"[0-9a-f]{7,}", sha)
    assert default_tag_in(project, tmp_path / "b") == f"3.4.5-{sha}"

    # An untracked file (build output, say) leaves the tree clean...
    (project / "notes.txt").write_text("x")
    assert default_tag_in(project, tmp_path / "c") == f"3.4.5-{sha}"
    # ...an uncommitted change to a tracked file does not.
    with open(project / "Cargo.toml", "a") as f:
        f.write("# changed\n")
    assert default_tag_in(project, tmp_path / "d") == f"3.4.5-{sha}-dirty"

    # A new commit, a new tag.
    git(project, "commit", "-q", "-am", "two")
    sha2 = git(project, "rev-parse", "--short", "HEAD")
    assert sha2 != sha
    assert default_tag_in(project, tmp_path / "e") == f"3.4.5-{sha2}"


def test_makefile_has_oci_target():
    text = (ROOT / "Makefile").read_text()
    assert "\noci: build\n" in text
    assert any(line.startswith(".PHONY:") and " oci" in line + " " for line in text.splitlines())


# --- examples/compose: the container layout, validated with the real Envoy ---

COMPOSE = ROOT / "examples/compose/docker-compose.yaml"


def compose_services():
    """The compose file as scripts/container.py reads it (the same reader
    `make run-container` and tests/tooling/test_container.py use)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import container
    return container.compose_services(COMPOSE), container.option


def envoy_bootstraps_under_examples():
    return [p for p in sorted((ROOT / "examples").rglob("*.yaml"))
            if re.search(r"^(static_resources|admin|dynamic_resources):", p.read_text(), re.M)]


def test_compose_layout_validates_in_envoy(tmp_path):
    services, option = compose_services()
    assert set(services) == {"upstream", "envoy"}
    checked = []
    for name, svc in services.items():
        assert svc["image"] == "envoyproxy/envoy:v1.40.0", "the Envoy the tests run"
        assert svc["network_mode"] == "host", "envoy/*.yaml talk over 127.0.0.1"
        # Rebuild the container's file system view under tmp_path.
        root = tmp_path / name
        for host, container, _mode in svc["volumes"]:
            src = (COMPOSE.parent / host).resolve()
            assert src.exists(), f"{name}: mounted {host} does not exist (run make build)"
            dst = root / container.lstrip("/")
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.symlink_to(src)
        config_path = option(svc["command"], "-c")
        config = root / config_path.lstrip("/")
        assert config.exists(), f"{name}: -c {config_path} is not mounted"
        cwd = root / svc["working_dir"].lstrip("/")
        cwd.mkdir(parents=True, exist_ok=True)
        p = subprocess.run([ENVOY, "--mode", "validate", "-c", str(config), "--base-id", str(next_base_id())],
                           cwd=cwd, capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, f"{name}:\n{(p.stdout + p.stderr)[-3000:]}"
        checked.append(name)
    # The front one really loaded sluice from the mounted path.
    assert "envoy" in checked


def test_every_envoy_bootstrap_under_examples_validates():
    """Any Envoy bootstrap YAML shipped under examples/ (none today: compose
    mounts envoy/*.yaml, which tests/e2e/test_config.py also validates)."""
    for path in envoy_bootstraps_under_examples():
        p = subprocess.run([ENVOY, "--mode", "validate", "-c", str(path), "--base-id", str(next_base_id())],
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, f"{path}:\n{(p.stdout + p.stderr)[-3000:]}"
    # Manifests and the compose file are not mistaken for bootstraps.
    assert COMPOSE not in envoy_bootstraps_under_examples()
