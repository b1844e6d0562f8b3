"""The extraction behind test_readme_serving.py: it finds the documented blocks, and a
README edit that breaks them fails with a message naming the file (the negative
controls for the extraction; the server run itself is in test_readme_serving.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmcache_connector.settings import ConnectorConfig
from lmcache_core.config import load_config

from . import doc_blocks as db
from .doc_blocks import DocBlockError


def readme() -> str:
    return db.README.read_text()


def test_documented_blocks_extract_and_agree():
    cmd = db.documented_commands()
    assert cmd.doc == db.README and cmd.argv[:5] == db.CPU_LAUNCHER
    assert "--no-enable-prefix-caching" in cmd.flags
    assert cmd.config_file() == "lmcache.yaml"
    ktc = cmd.kv_transfer_config()
    assert ktc["kv_role"] == "kv_both" and ktc["kv_load_failure_policy"] == "recompute"
    script = cmd.substituted("/models/my model", 18123)
    assert "'/models/my model'" in script and "--port 18123" in script and "MODEL" not in script


def test_documented_json_is_a_valid_vllm_kv_transfer_config():
    from vllm.config import KVTransferConfig

    cfg = KVTransferConfig(**db.documented_commands().kv_transfer_config())
    assert cfg.kv_connector == "LMCacheCoreConnector" and cfg.is_kv_transfer_instance


def test_documented_yaml_loads_with_only_absolute_paths_moved(tmp_path: Path):
    doc = db.documented_yaml(tmp_path)
    assert doc.rewrites, "README.md's YAML names no absolute tier path: the disk-tier check needs one"
    expected = db.fenced_block(readme(), db.README, db.YAML_MARKER, "yaml")
    for old, new in doc.rewrites.items():
        assert Path(old).is_absolute() and Path(new).parent == tmp_path
        expected = expected.replace(old, new)
    assert doc.text == expected  # nothing but those paths changed
    (tmp_path / "lmcache.yaml").write_text(doc.text)
    cfg = load_config(tmp_path / "lmcache.yaml", model=ConnectorConfig).config
    assert [b.name for b in cfg.backends] == ["local_cpu", "disk"]


@pytest.mark.parametrize(
    "old, new, message",
    [
        ("<!-- serve-cpu:", "<!-- serve-gpu:", "marker line '<!-- serve-cpu -->' not found"),
        (
            "python -m vllm.entrypoints.openai.api_server --model MODEL",
            "vllm serve MODEL",
            "must start with 'python -m vllm.entrypoints.openai.api_server --model MODEL'",
        ),
        ('"kv_role": "kv_both",\n', '"kv_role": "kv_both"\n', "not valid JSON"),
        ("--port 8000 \\\n  --no-enable", "--port 9000 \\\n  --no-enable", "expected '--port 8000' once"),
        ('"config_file": "lmcache.yaml"', '"config_file": "/etc/lmcache.yaml"', "must name a relative YAML file"),
        ("--host 127.0.0.1 --port 8000 \\\n  --no-enable", "--port 8000\n  --no-enable", "one command"),
        ("--kv-transfer-config '", "--kv-events-config '", "expected one --kv-transfer-config '<json>'"),
    ],
)
def test_broken_cpu_block_fails_naming_readme(old: str, new: str, message: str):
    text = readme()
    assert text.count(old) >= 1, f"fixture out of date: {old!r} not in README.md"
    broken = text.replace(old, new, 1)  # the first occurrence is the serve-cpu block
    with pytest.raises(DocBlockError) as err:
        db.documented_commands(readme_text=broken)
    assert "README.md" in str(err.value) and message in str(err.value)


def test_cuda_block_drifting_from_cpu_block_fails():
    text = readme()
    cuda = text.index("<!-- serve-cuda")
    broken = text[:cuda] + text[cuda:].replace("--no-enable-prefix-caching", "--enable-prefix-caching", 1)
    with pytest.raises(DocBlockError, match="README.md .block <!-- serve-cuda -->.: its flags differ"):
        db.documented_commands(readme_text=broken)


def test_connector_doc_drifting_fails_naming_it():
    text = db.CONNECTOR_DOC.read_text()
    broken = text.replace('"kv_load_failure_policy": "recompute"', '"kv_load_failure_policy": "fail"', 1)
    with pytest.raises(DocBlockError, match="connector.md .block <!-- serve-cpu -->.: its flags differ"):
        db.documented_commands(connector_text=broken)


def test_missing_or_unclosed_yaml_block_fails(tmp_path: Path):
    text = readme()
    with pytest.raises(DocBlockError, match="README.md .block <!-- lmcache-yaml -->.: marker line"):
        db.documented_yaml(tmp_path, readme_text=text.replace("<!-- lmcache-yaml", "<!-- yaml", 1))
    start = text.index("<!-- lmcache-yaml")
    unclosed = text[: text.index("```yaml\n", start)] + "```yaml\nchunk_size: 256\n"  # no closing fence
    with pytest.raises(DocBlockError, match="not closed"):
        db.documented_yaml(tmp_path, readme_text=unclosed)


def test_substitution_refuses_a_second_placeholder():
    cmd = db.documented_commands()
    twice = db.ServeCommand(cmd.doc, cmd.marker, cmd.script + " # MODEL", cmd.argv, cmd.launcher)
    with pytest.raises(DocBlockError, match="placeholder MODEL appears 2 times"):
        twice.substituted("/m", 1)
    assert json.loads(json.dumps(cmd.kv_transfer_config()))  # plain JSON, no placeholders inside
