"""The converted-model cache heals: an integrity record written at conversion and checked at every
load, damaged copies reported and rebuilt, temporary folders never left behind, the destination
checked before the slow conversion. Small fake folders stand in for the real copy, except in one
slow test that damages a copy of it (never the shared cache)."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import kvlearn.model as km
import kvlearn.model_store as ks
from kvlearn.workshop import envcheck


def fake_copy(folder: Path) -> Path:
    """A small stand-in for a converted copy, with its integrity record."""
    folder.mkdir(parents=True)
    for name in ks.NEEDED_FILES:
        (folder / name).write_bytes(f"{name} ".encode() * 1000)
    ks.write_integrity_record(folder)
    return folder


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """KVLEARN_CACHE in a temporary folder; returns the copy's folder (not made yet)."""
    monkeypatch.setenv("KVLEARN_CACHE", str(tmp_path / "cache"))
    return ks.cache_dir()


def test_cache_dir_expands_home_and_treats_empty_as_unset(monkeypatch):
    default = Path.home() / ".cache" / "kvlearn" / ks.cache_dir().name
    monkeypatch.setenv("KVLEARN_CACHE", "")
    assert ks.cache_dir() == default
    monkeypatch.delenv("KVLEARN_CACHE")
    assert ks.cache_dir() == default
    monkeypatch.setenv("KVLEARN_CACHE", "~/elsewhere")
    assert ks.cache_dir() == Path.home() / "elsewhere" / default.name


def damage(folder: Path, how: str) -> None:
    weights = folder / "model.safetensors"
    if how == "missing config.json":
        (folder / "config.json").unlink()
    elif how == "truncated":
        weights.write_bytes(weights.read_bytes()[:100])
    elif how == "zeroed":
        weights.write_bytes(bytes(weights.stat().st_size))
    elif how == "garbage record":
        (folder / ks.INTEGRITY_FILE).write_text("{not json")
    elif how == "record without files":
        (folder / ks.INTEGRITY_FILE).write_text('{"files": {"config.json": {"bytes": 1, "xxh3_64": "0"}}}')
    elif how == "missing record":
        (folder / ks.INTEGRITY_FILE).unlink()


DAMAGE = {"missing config.json": "config.json is missing", "truncated": "model.safetensors has 100 bytes",
          "zeroed": "model.safetensors does not match", "garbage record": "unreadable",
          "record without files": "does not list", "missing record": f"no {ks.INTEGRITY_FILE}"}


@pytest.mark.parametrize("how", DAMAGE)
def test_each_kind_of_damage_is_named(tmp_path, how):
    folder = fake_copy(tmp_path / "copy")
    assert ks.cache_problem(folder) is None
    damage(folder, how)
    assert DAMAGE[how] in ks.cache_problem(folder)


def test_a_damaged_copy_is_reported_with_its_folder_and_rebuilt(cache, monkeypatch):
    fake_copy(cache)
    damage(cache, "zeroed")
    rebuilt = []

    def convert(target):
        rebuilt.append(target)
        shutil.rmtree(target)
        fake_copy(target)

    monkeypatch.setattr(ks, "_convert", convert)
    with pytest.warns(UserWarning, match=f"{cache}.*damaged.*does not match"):
        assert ks.converted_copy() == cache
    assert rebuilt == [cache] and ks.cache_problem(cache) is None
    assert ks.converted_copy() == cache and rebuilt == [cache]  # a whole copy is not rebuilt again
    assert envcheck.converted_model().status == "OK"
    damage(cache, "missing config.json")
    check = envcheck.converted_model()
    assert check.status == "NOTE" and "damaged" in check.detail and "config.json is missing" in check.detail


def test_a_copy_still_damaged_after_the_rebuild_is_an_error_naming_the_folder(cache, monkeypatch):
    monkeypatch.setattr(ks, "_convert", lambda target: None)
    with pytest.raises(RuntimeError, match=f"{cache}.*does not exist"):
        ks.converted_copy()


def test_install_replaces_a_damaged_copy_and_keeps_a_whole_one(tmp_path):
    target = fake_copy(tmp_path / "copy")
    damage(target, "truncated")
    new = fake_copy(tmp_path / ".tmp-new")
    ks.install_copy(new, target)
    assert ks.cache_problem(target) is None and not new.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy"]  # the damaged copy was removed
    other = fake_copy(tmp_path / ".tmp-other")
    (other / "config.json").write_text("different")
    ks.install_copy(other, target)  # another process installed a whole copy first: it stays
    assert (target / "config.json").read_text() != "different"


def refuse_gguf(*args, **kwargs):
    raise AssertionError("the GGUF was read before the destination was checked")


@pytest.mark.parametrize("where", ["copy folder", "cache root"])
def test_a_file_in_the_way_is_reported_before_converting(tmp_path, monkeypatch, where):
    monkeypatch.setenv("KVLEARN_CACHE", str(tmp_path / "cache"))
    blocker = ks.cache_dir() if where == "copy folder" else ks.cache_dir().parent
    blocker.parent.mkdir(parents=True, exist_ok=True)
    blocker.write_text("not a folder")
    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", refuse_gguf)
    with pytest.raises(NotADirectoryError, match=f"{blocker} is a file.*KVLEARN_CACHE"):
        km.load_model(device="cpu")


def test_an_unwritable_cache_is_reported_before_converting(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLEARN_CACHE", str(tmp_path))

    def no_permission(**kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(ks.tempfile, "mkdtemp", no_permission)
    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", refuse_gguf)
    with pytest.raises(PermissionError, match=f"Cannot write the model cache in {tmp_path}.*KVLEARN_CACHE"):
        km.load_tokenizer()


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, OSError])
def test_the_temporary_folder_is_removed_on_any_exit(cache, monkeypatch, interrupt):
    def stop(*args, **kwargs):
        assert len(list(cache.parent.glob(ks.TMP_PREFIX + "*"))) == 1  # the conversion's own folder exists
        raise interrupt("stopped during the conversion")

    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", stop)
    with pytest.raises(interrupt):
        km.load_model(device="cpu")
    assert list(cache.parent.iterdir()) == []


def test_stale_temporary_folders_are_removed_and_live_ones_kept(tmp_path):
    host = ks.socket.gethostname()
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(finished.stdout)
    names = {f".tmp-{dead}@{host}@abc": False,             # its process is gone
             f".tmp-{os.getpid()}@{host}@abc": True,        # a live conversion (this process)
             f".tmp-{dead}@another-host@abc": True,         # cannot tell from here, and it is young
             ".tmp-old-style": True,                        # no owner in the name, young
             ".tmp-old-and-stale": False,                   # no owner in the name, two hours old
             "smollm2-135m-instruct-0.1.2": True}           # not a temporary folder at all
    for name in names:
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_text("partial")
    two_hours_ago = time.time() - 2 * ks.STALE_TMP_SECONDS
    os.utime(tmp_path / ".tmp-old-and-stale", (two_hours_ago, two_hours_ago))
    ks.remove_stale_tmp(tmp_path)
    assert {p.name for p in tmp_path.iterdir()} == {name for name, kept in names.items() if kept}


@pytest.mark.thorough   # the rebuild on the real model; the tests above prove each step on small copies
def test_a_damaged_copy_of_the_real_model_is_rebuilt_with_the_same_weights(tmp_path, monkeypatch, model):
    """Zero 1 MiB of the weights in a copy of the converted model: the next load says so and rebuilds
    it, and the rebuilt model has the original weights. The shared cache is only read."""
    copy = tmp_path / ks.cache_dir().name
    shutil.copytree(ks.converted_copy(), copy)
    monkeypatch.setenv("KVLEARN_CACHE", str(tmp_path))
    with open(copy / "model.safetensors", "r+b") as f:
        f.seek(100_000_000)
        f.write(bytes(2**20))
    with pytest.warns(UserWarning, match=f"{copy}.*damaged.*model.safetensors does not match"):
        rebuilt, _ = km.load_model(device="cpu")
    assert ks.cache_problem(copy) is None
    assert [p.name for p in tmp_path.iterdir()] == [copy.name]
    for (name, a), b in zip(model.state_dict().items(), rebuilt.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
