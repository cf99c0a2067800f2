"""The shipped JSON Schema (docs/sluice.schema.json, generated from the
filter's own types) and `make check-config` (sluice-check, the filter's own
validation code) agree with every example and every configuration snippet in
the docs, and refuse what the filter refuses."""

import json
import os
import re
import subprocess

import jsonschema
import pytest

from harness import ROOT

SCHEMA = json.loads((ROOT / "docs/sluice.schema.json").read_text())
TOP = set(SCHEMA["properties"])
CHECK = [str(ROOT / "target/debug/sluice-check")]


def setup_module():
    # Compiled as `make lint` compiles it (the Makefile's LINTED), so that
    # after it this finds the binary built.
    env = dict(os.environ, RUSTC_WORKSPACE_WRAPPER=str(ROOT / "scripts/clippy-rustc"))
    subprocess.run(["cargo", "build", "--quiet", "--features", "schema", "--bin", "sluice-check"],
                   cwd=ROOT, check=True, timeout=600, env=env)


def snippets():
    """Every ```json block of the README and docs/ that is a whole plugin
    configuration (an object whose keys are top-level fields)."""
    out = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for i, block in enumerate(re.findall(r"```json\n(.*?)```", doc.read_text(), re.S)):
            try:
                v = json.loads(block)
            except ValueError:
                continue
            if isinstance(v, dict) and v and set(v) <= TOP:
                out.append(pytest.param(block, id=f"{doc.name}#{i}"))
    return out


CONFIGS = [pytest.param(p.read_text(), id=p.name) for p in sorted((ROOT / "examples").glob("*.json"))] + snippets()


def check(text):
    return subprocess.run(CHECK + ["-"], input=text, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("text", CONFIGS)
def test_examples_and_doc_snippets_fit_the_schema_and_pass_the_check(text):
    jsonschema.validate(json.loads(text), SCHEMA)
    p = check(text)
    assert p.returncode == 0 and p.stdout.strip() == "-: ok", p.stdout + p.stderr


def test_there_are_snippets_to_check():
    assert len(snippets()) >= 3


def test_the_check_lists_every_problem_with_its_field_and_fails():
    bad = {"domain": "a b", "rate_limits": [
        {"name": "ok", "bucket": {"rate": 1, "period": "1s"}},
        {"name": "r", "bucket": {"rate": 0, "period": "1s"}},
        {"name": "s", "bucket": [1, "1s"]}]}
    p = check(json.dumps(bad))
    assert p.returncode == 1, p.stdout
    lines = p.stdout.splitlines()
    assert any(l.startswith("-: domain: ") for l in lines), lines
    assert any(l.startswith("-: rate_limits[1].bucket.rate: must be greater than 0") for l in lines), lines
    assert any(l.startswith("-: rate_limits[2].bucket: invalid type: sequence, expected a JSON object") for l in lines), lines


def test_the_schema_refuses_what_the_filter_refuses_by_shape():
    for bad in ({"rate_limit": []}, {"rate_limits": [{"name": "a", "bucket": {"rate": 1, "period": "1s"}, "burts": 3}]},
                {"response": [429]}, {"rate_limits": [{"name": "a", "bucket": [3, "2s", 4]}]}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, SCHEMA)
        assert check(json.dumps(bad)).returncode == 1
