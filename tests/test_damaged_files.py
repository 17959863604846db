"""Every damaged file kvrag reads or writes is repaired or named in one line (issue #85).

A model directory kvrag converted from a GGUF file is converted again when one of its files does not load;
a user's own model directory is never touched, its damaged file named in one line. Writes fsync and, on a
full disk, raise DiskFullError naming the directory and leave no temporary file. The disk is really full:
a small tmpfs mounted in a user and mount namespace of its own (`unshare`), which needs no root.
"""

import errno
import json
import os
import resource
import re
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
from tiny import CHATML, tiny_tokenizer

from kvrag import KVEngine, ModelFileError, loading, paths
from kvrag.errors import DiskFullError
from kvrag.paths import write_atomic

KVRAG = Path(sys.executable).with_name("kvrag")
PASSAGES = ["The lighthouse of Varnholm was built in 1873 by the engineer Ilsa Brandt.",
            "The river Olm freezes every winter, and the ferry stops until spring."]
QUESTION = "Who built the lighthouse?"


def write_tiny_gguf(path: Path) -> Path:
    """A tiny random-weight Llama as a float32 GGUF file, laid out as llama.cpp writes SmolLM2's (a gpt2
    tokenizer, the chat template in the metadata): what `convert_gguf` reads for the default model."""
    import gguf

    tok = tiny_tokenizer()
    spec = json.loads(tok.backend_tokenizer.to_str())
    tokens = sorted(spec["model"]["vocab"], key=spec["model"]["vocab"].get)
    hidden, inner, layers, heads, kv_heads = 64, 128, 2, 4, 2
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny llama")
    writer.add_block_count(layers)
    writer.add_context_length(1024)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inner)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t.startswith("<|") else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)
    rng = np.random.default_rng(0)
    weight = lambda *shape: (rng.standard_normal(shape) * 0.08).astype(np.float32)  # noqa: E731
    writer.add_tensor("token_embd.weight", weight(len(tokens), hidden))
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    head_dim = hidden // heads
    for b in range(layers):
        for name, value in [("attn_norm", np.ones(hidden, np.float32)), ("ffn_norm", np.ones(hidden, np.float32)),
                            ("attn_q", weight(hidden, hidden)), ("attn_k", weight(kv_heads * head_dim, hidden)),
                            ("attn_v", weight(kv_heads * head_dim, hidden)), ("attn_output", weight(hidden, hidden)),
                            ("ffn_gate", weight(inner, hidden)), ("ffn_up", weight(inner, hidden)),
                            ("ffn_down", weight(hidden, inner))]:
            writer.add_tensor(f"blk.{b}.{name}.weight", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def tiny_gguf(tmp_path) -> Path:
    return write_tiny_gguf(tmp_path / "tiny.gguf")


@pytest.fixture
def notes(tmp_path) -> Path:
    """A folder of notes to `kvrag index`."""
    folder = tmp_path / "notes"
    folder.mkdir()
    for i, text in enumerate(PASSAGES):
        (folder / f"note{i}.md").write_text(text + "\n")
    return folder


def kvrag(*args, home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "KVRAG_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([str(KVRAG), "--device", "cpu", *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=300)


def lines(stderr: str) -> list[str]:
    """stderr's lines, progress bars (redrawn after a \\r) left out."""
    return [line for line in re.split(r"[\r\n]", stderr) if line.strip() and "%|" not in line]


def converted_dir(home: Path) -> Path:
    [directory] = [p for p in (home / "models").iterdir() if not p.name.startswith(".")]
    return directory


def answers(engine) -> bool:
    engine.index(PASSAGES, progress=False)
    return engine.generate(QUESTION, PASSAGES, max_new_tokens=3).generated_tokens > 0


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def garble_in_place(path: Path, garbage: bytes) -> None:
    """Overwrite the start of a file, keeping its size: only loading it tells it is damaged."""
    with open(path, "r+b") as f:
        f.write(garbage)


DAMAGES = {  # file of a model directory, damage, what the one line calls the file
    "truncated weights": ("model.safetensors", truncate, "cannot load the weights"),
    "weights with a garbage header": ("model.safetensors", lambda p: garble_in_place(p, b"\xff" * 16),
                                      "cannot load the weights"),
    "chat template not jinja": ("chat_template.jinja", lambda p: garble_in_place(p, b"{% for %}{{"),
                                "cannot read the chat template"),
    "chat template not UTF-8": ("chat_template.jinja", lambda p: garble_in_place(p, b"\xff\xfe\x00\x81"),
                                "cannot read the chat template"),
    "garbage tokenizer.json": ("tokenizer.json", lambda p: garble_in_place(p, b"\x00garbage"),
                               "cannot read the tokenizer"),
    "tokenizer.json of another shape": ("tokenizer.json", lambda p: p.write_text('{"version": "1.0"}'),
                                        "cannot read the tokenizer"),
    "garbage config.json": ("config.json", lambda p: garble_in_place(p, b"#!"), "cannot read the model config"),
}


# ---- a model kvrag converted from a GGUF file: converted again ------------------------------------------


@pytest.mark.parametrize("damage", [*DAMAGES, "tokenizer.json deleted", "completion record garbled"])
def test_a_damaged_converted_model_is_converted_again_from_its_gguf(tiny_gguf, tmp_path, damage):
    home = tmp_path / "home"
    first = KVEngine.from_pretrained(str(tiny_gguf), device="cpu", home=home)
    directory = converted_dir(home)
    assert loading.incomplete(directory) is None
    if damage == "tokenizer.json deleted":
        (directory / "tokenizer.json").unlink()
        reason = "no tokenizer.json"
    elif damage == "completion record garbled":
        (directory / loading.CONVERTED).write_bytes(b"\x00\x01")
        reason = f"unreadable {loading.CONVERTED}"
    else:  # a file that lost bytes is caught by its size, one damaged in place when it is loaded
        reason, spoil, _ = DAMAGES[damage]
        spoil(directory / reason)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = KVEngine.from_pretrained(str(tiny_gguf), device="cpu", home=home)
    said = [str(w.message) for w in caught if "is damaged" in str(w.message)]
    assert len(said) == 1 and said[0].startswith(f"kvrag: {directory} is damaged (")
    assert reason in said[0] and said[0].endswith(f"); rebuilding it from {tiny_gguf}") and "\n" not in said[0]
    assert converted_dir(home) == directory and loading.incomplete(directory) is None
    assert again.fingerprint == first.fingerprint and answers(again)
    assert not [p for p in (home / "models").iterdir() if p.name.startswith(".")]  # nothing left aside
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        KVEngine.from_pretrained(str(tiny_gguf), device="cpu", home=home)
    assert not [w for w in caught if "damaged" in str(w.message)]  # the rebuilt directory loads without a word


def test_the_first_load_says_it_converts_in_two_lines_and_no_load_shows_a_progress_bar(tiny_gguf, tmp_path, capfd):
    home = tmp_path / "home"
    KVEngine.from_pretrained(str(tiny_gguf), device="cpu", home=home)
    said = capfd.readouterr().err.splitlines()
    converting = [line for line in said if "convert" in line]
    assert len(converting) == 2 and converting[0].startswith(f"kvrag: converting {tiny_gguf.name} to safetensors")
    assert re.fullmatch(rf"kvrag: converted {re.escape(tiny_gguf.name)} in \d+ s", converting[1])
    KVEngine.from_pretrained(str(tiny_gguf), device="cpu", home=home)
    again = capfd.readouterr().err
    assert not [line for line in said + again.splitlines() if "%|" in line or "Loading" in line], said
    assert "convert" not in again


@pytest.mark.parametrize("damage", ["truncated weights", "chat template not jinja"])
def test_kvrag_index_rebuilds_a_damaged_converted_model_and_says_so_in_one_line(tiny_gguf, notes, tmp_path, damage):
    home = tmp_path / "home"
    loading.convert_gguf(tiny_gguf, home)
    directory = converted_dir(home)
    name, spoil, _ = DAMAGES[damage]
    spoil(directory / name)
    run = kvrag("--model", tiny_gguf, "index", notes, home=home)
    assert run.returncode == 0, run.stderr
    assert "indexed 2 passages from 2 files" in run.stdout
    said = [line for line in lines(run.stderr) if "damaged" in line]
    expected = (rf"kvrag: {re.escape(str(directory))} is damaged \(.*{name}.*\); "
                rf"rebuilding it from {re.escape(str(tiny_gguf))}")
    assert len(said) == 1 and re.fullmatch(expected, said[0]), run.stderr
    assert "Traceback" not in run.stderr and loading.incomplete(directory) is None


def test_a_converted_model_is_never_reused_incomplete(tiny_gguf, tmp_path):
    """What the completion record is for: a directory whose files lost bytes is not handed out."""
    home = tmp_path / "home"
    directory = loading.convert_gguf(tiny_gguf, home)
    record = json.loads((directory / loading.CONVERTED).read_text())
    assert record["gguf"] == str(tiny_gguf)
    assert record["files"] == {p.name: p.stat().st_size for p in directory.iterdir() if p.name != loading.CONVERTED}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(record["files"])
    truncate(directory / "model.safetensors")
    size = record["files"]["model.safetensors"]
    assert loading.incomplete(directory) == f"model.safetensors has {size // 2} bytes, {size} were written"
    with pytest.warns(RuntimeWarning, match="is damaged"):
        assert loading.convert_gguf(tiny_gguf, home) == directory
    assert loading.incomplete(directory) is None


def test_a_garbage_gguf_file_is_named_in_one_line(tiny_gguf, tmp_path):
    truncate(tiny_gguf)
    with pytest.raises(ModelFileError, match=f"^cannot read the GGUF file {re.escape(str(tiny_gguf))}: [^\n]+$"):
        KVEngine.from_pretrained(str(tiny_gguf), device="cpu", home=tmp_path / "home")
    assert list((tmp_path / "home" / "models").iterdir()) == []  # no half-converted directory


# ---- a user's own model directory: never modified, the damaged file named in one line ---------------------


def snapshot(directory: Path) -> dict:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(directory.iterdir())}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_file_of_a_users_model_is_named_and_left_alone(saved_model_and_adapter, tmp_path, damage):
    model_dir, _ = saved_model_and_adapter
    name, spoil, what = DAMAGES[damage]
    good = (model_dir / name).read_bytes()
    spoil(model_dir / name)
    before = snapshot(model_dir)
    with pytest.raises(ModelFileError) as raised:
        KVEngine.from_pretrained(str(model_dir), device="cpu", home=tmp_path / "home")
    message = str(raised.value)
    assert message.startswith(f"{what} {model_dir / name}: ") and "\n" not in message, message
    assert raised.value.path == model_dir / name
    assert snapshot(model_dir) == before  # not repaired, moved or rewritten: it is the user's
    (model_dir / name).write_bytes(good)  # the user puts the file back: the next call works
    assert answers(KVEngine.from_pretrained(str(model_dir), device="cpu", home=tmp_path / "home"))


@pytest.mark.parametrize("damage", ["chat template not UTF-8", "garbage tokenizer.json"])
def test_kvrag_index_names_a_damaged_file_of_a_users_model_in_one_line(saved_model_and_adapter, notes, tmp_path,
                                                                       damage):
    model_dir, _ = saved_model_and_adapter
    name, spoil, what = DAMAGES[damage]
    spoil(model_dir / name)
    run = kvrag("--model", model_dir, "index", notes, home=tmp_path / "home")
    assert run.returncode == 2
    said = lines(run.stderr)
    assert len(said) == 1 and said[0].startswith(f"kvrag: error: {what} {model_dir / name}: "), run.stderr


def test_a_missing_weights_file_names_the_directory(saved_model_and_adapter, tmp_path):
    model_dir, _ = saved_model_and_adapter
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(ModelFileError, match=f"^cannot load the weights in {re.escape(str(model_dir))}: .*no file"):
        KVEngine.from_pretrained(str(model_dir), device="cpu", home=tmp_path / "home")


def test_weights_rewritten_in_place_with_their_mtime_restored_are_hashed_again(saved_model_and_adapter, tmp_path):
    """Same path, size, modification time and safetensors header, other values: the inode change time tells."""
    model_dir, _ = saved_model_and_adapter
    home = tmp_path / "home"
    first = KVEngine.from_pretrained(str(model_dir), device="cpu", home=home)
    digest = loading.weights_digest(first.model)  # now: the loaded weights may map the file and change with it
    weights = model_dir / "model.safetensors"
    stat, header_digest = weights.stat(), paths.safetensors_header_digest(weights)
    header = 8 + int.from_bytes(weights.read_bytes()[:8], "little")
    with open(weights, "r+b") as f:  # the same inode, other values in the first tensor
        f.seek(header)
        f.write(np.full(64, 0.5, np.float32).tobytes())
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    after = weights.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (stat.st_ino, stat.st_size, stat.st_mtime_ns)
    assert paths.safetensors_header_digest(weights) == header_digest
    again = KVEngine.from_pretrained(str(model_dir), device="cpu", home=home)
    assert loading.weights_digest(again.model) != digest
    assert again.fingerprint != first.fingerprint
    assert again.fingerprint == loading.fingerprint(again.model, again.tokenizer)  # what hashing gives


# ---- writes on a full disk ----------------------------------------------------------------------------


def on_small_disk(script: str, mount: Path, size: str = "256k", timeout: int = 300) -> subprocess.CompletedProcess:
    """Run a bash script with a tmpfs of `size` mounted at `mount`, in a user and mount namespace of its
    own (no root needed; the mount ends with the script). $KVRAG, $PYTHON name the programs."""
    mount.mkdir(parents=True, exist_ok=True)
    script = f"set -u\nmount -t tmpfs -o size={size},mode=0700 tmpfs {mount}\n" + textwrap.dedent(script)
    env = {**os.environ, "KVRAG": str(KVRAG), "PYTHON": sys.executable, "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "bash", "-c", script],
                         capture_output=True, text=True, env=env, timeout=timeout)
    assert "mount:" not in run.stderr, run.stderr  # the namespace and its tmpfs are there
    return run


def test_writes_on_a_full_disk_raise_disk_full_and_leave_no_temporary_file(tiny_gguf, tmp_path):
    """write_atomic (every KV file, every remembered fingerprint) and a GGUF conversion, on a disk that
    fills up after a first file: one error naming the directory and the bytes needed, nothing half-written."""
    disk, out = tmp_path / "disk", tmp_path / "out.json"
    program = textwrap.dedent(f"""
        import json
        from pathlib import Path
        from kvrag import loading
        from kvrag.errors import DiskFullError, KVRagError
        from kvrag.paths import write_atomic
        disk = Path({str(disk)!r})
        kept = disk / "sub" / "kept.bin"
        write_atomic(kept, b"k" * 5000)  # written while there is room
        with open(disk / "filler", "wb", buffering=0) as f:  # then the disk fills up
            try:
                while True:
                    f.write(bytes(4096))
            except OSError:
                pass
        result = {{}}
        for name, data in [("new", b"n" * 1_234_567), ("replace", b"r" * 3000)]:
            target = disk / "sub" / ("new.bin" if name == "new" else "kept.bin")
            try:
                write_atomic(target, data)
            except DiskFullError as exc:
                result[name] = [str(exc), exc.errno, isinstance(exc, OSError), isinstance(exc, KVRagError)]
        result["kept"] = kept.read_bytes() == b"k" * 5000
        (disk / "filler").unlink()
        (disk / "filler").write_bytes(bytes(150_000))  # room for some of the converted weights, not all
        try:
            loading.convert_gguf(Path({str(tiny_gguf)!r}), disk / "home")
        except DiskFullError as exc:
            result["convert"] = str(exc)
        result["files"] = sorted(str(p.relative_to(disk)) for p in disk.rglob("*") if not p.is_dir())
        Path({str(out)!r}).write_text(json.dumps(result))
    """)
    run = on_small_disk(f'"$PYTHON" -c {shlex.quote(program)}\n', disk)
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())
    assert result["new"] == [f"no space left in {disk / 'sub'} (needed 1.2 MB)", errno.ENOSPC, True, True]
    assert result["replace"] == [f"no space left in {disk / 'sub'} (needed 3.0 kB)", errno.ENOSPC, True, True]
    assert result["kept"]  # the file it would have replaced is whole
    assert re.fullmatch(rf"no space left in {re.escape(str(disk / 'home' / 'models'))} \(needed \d+\.\d kB\)",
                        result["convert"]), result["convert"]
    remembered = [f for f in result["files"] if f.startswith("home/fingerprints/")]  # the GGUF's digest, whole
    assert len(remembered) <= 1 and all(f.endswith(".json") for f in remembered)
    assert [f for f in result["files"] if f not in remembered] == ["filler", "sub/kept.bin"]  # no temporary file, no
    # half-converted model


def test_other_write_errors_pass_through_and_leave_no_temporary_file(tmp_path):
    """A file-size limit (EFBIG) is no full disk: raised as it is, still without a temporary file left."""
    limit, handler = resource.getrlimit(resource.RLIMIT_FSIZE), signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (10_000, limit[1]))
    try:
        with pytest.raises(OSError) as raised:
            write_atomic(tmp_path / "big.bin", b"x" * 20_000)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, handler)
    assert raised.value.errno == errno.EFBIG and not isinstance(raised.value, DiskFullError)
    assert list(tmp_path.iterdir()) == []


def test_kvrag_index_on_a_full_disk_says_so_in_one_line_and_keeps_what_it_wrote(saved_model_and_adapter, notes,
                                                                                  tmp_path):
    """The KV directory on a small disk: the first notes fit, then the disk is full when more come."""
    model_dir, _ = saved_model_and_adapter
    home, report = tmp_path / "home", tmp_path / "report"
    report.mkdir()
    (notes / "more.md").write_text("Ilsa Brandt also designed two bridges over the Olm, in 1880 and 1884.\n")
    first = tmp_path / "first"
    first.mkdir()
    shutil.copy(notes / "note0.md", first)
    script = f"""
        export KVRAG_HOME={home}
        "$KVRAG" --device cpu --model {model_dir} index {first} > {report}/out1 2> {report}/err1; echo $? > {report}/rc1
        find {home}/kv -type f -name '*.safetensors' -exec sha256sum {{}} + | sort > {report}/before
        cat /dev/zero > {home}/kv/filler 2> /dev/null
        "$KVRAG" --device cpu --model {model_dir} index {notes} > {report}/out2 2> {report}/err2; echo $? > {report}/rc2
        find {home}/kv -type f -name '*.safetensors' -exec sha256sum {{}} + | sort > {report}/after
        find {home} -name '*.tmp' > {report}/tmp
    """
    on_small_disk(script, home / "kv", size="1m")
    read = lambda name: (report / name).read_text()  # noqa: E731
    assert read("rc1").strip() == "0", read("err1")
    before = read("before").splitlines()
    assert len(before) >= 2  # the prefix and the first note
    err = read("err2")
    assert read("rc2").strip() == "2" and "Traceback" not in err, err
    assert lines(err)[-1].startswith("kvrag: error: ") and f"no space left in {home / 'kv'}" in err, err
    assert read("tmp") == ""  # no temporary file left behind
    assert set(before) <= set(read("after").splitlines())  # the KV written earlier is intact




def test_kvrag_index_and_ask_with_chroma_on_a_full_disk_say_so_in_one_line(saved_model_and_adapter, notes, tmp_path):
    """The passage index (embedded Chroma) on a disk that fills: `index` and then `ask` end in one line naming
    it, not Chroma's traceback."""
    model_dir, _ = saved_model_and_adapter
    home, report = tmp_path / "home", tmp_path / "report"
    report.mkdir()
    script = f"""
        export KVRAG_HOME={home}
        cat /dev/zero > {home}/chroma-filler 2> /dev/null
        "$KVRAG" --device cpu --model {model_dir} index {notes} > {report}/out1 2> {report}/err1; echo $? > {report}/rc1
        "$KVRAG" --device cpu --model {model_dir} ask "{QUESTION}" > {report}/out2 2> {report}/err2; echo $? > {report}/rc2
    """
    on_small_disk(script, home, size="256k")
    read = lambda name: (report / name).read_text()  # noqa: E731
    for n in (1, 2):
        err = read(f"err{n}")
        assert read(f"rc{n}").strip() == "2" and "Traceback" not in err, err
        assert lines(err)[-1].startswith(f"kvrag: error: no space left in {home}"), err
        assert "for the passage index (Chroma)" in lines(err)[-1], err


def test_kvrag_index_and_ask_with_the_passage_registry_on_a_full_disk_say_so_in_one_line(saved_model_and_adapter, notes,
                                                                                         tmp_path):
    """passages.sqlite (the passage registry beside the KV) on a disk that is full: `index` adding to it, then `index`
    and `ask` making it afresh, each end in one line naming its directory, not SQLite's traceback, and the registry
    is not moved aside as damaged."""
    model_dir, _ = saved_model_and_adapter
    home, report = tmp_path / "home", tmp_path / "report"
    report.mkdir()
    kvrag = f'"$KVRAG" --device cpu --model {model_dir}'
    forget = ("import glob, sqlite3; db = sqlite3.connect(glob.glob(%r)[0], isolation_level=None); "
              "db.execute('DELETE FROM passages'); db.execute('VACUUM')" % f"{home}/kv/*/passages.sqlite")
    script = f"""
        export KVRAG_HOME={home}
        {kvrag} index {notes} > /dev/null 2> {report}/err0; echo $? > {report}/rc0
        "$PYTHON" -c "{forget}"
        cat /dev/zero > {home}/kv/filler 2> /dev/null
        {kvrag} index {notes} > /dev/null 2> {report}/err1; echo $? > {report}/rc1
        rm {home}/kv/*/passages.sqlite
        {kvrag} index {notes} > /dev/null 2> {report}/err2; echo $? > {report}/rc2
        {kvrag} ask "{QUESTION}" --max-new-tokens 2 > /dev/null 2> {report}/err3; echo $? > {report}/rc3
        ls {home}/kv/*/ > {report}/files
    """
    on_small_disk(script, home / "kv", size="1m")
    read = lambda name: (report / name).read_text()  # noqa: E731
    assert read("rc0").strip() == "0", read("err0")
    for n in (1, 2, 3):  # the registry there without these passages; made afresh by `index`; by `ask`
        err = read(f"err{n}")
        assert read(f"rc{n}").strip() == "2" and "Traceback" not in err, err
        assert re.fullmatch(rf"kvrag: error: no space left in {re.escape(str(home / 'kv'))}/[0-9a-f]{{16}} \(needed .*\)",
                            lines(err)[-1]), err
    assert "damaged" not in read("files")  # a full disk is no damaged registry: nothing moved aside


def test_kvrag_ask_on_a_full_disk_answers_as_before_and_says_so_once(saved_model_and_adapter, notes, tmp_path):
    """A request whose passages' KV cannot be written (their files gone, the disk full) computes them, keeps
    them in memory and answers as it did before, with one line naming the directory."""
    model_dir, _ = saved_model_and_adapter
    home, report = tmp_path / "home", tmp_path / "report"
    report.mkdir()
    ask = f'"$KVRAG" --device cpu --model {model_dir} ask "{QUESTION}" --top-k 3 --max-new-tokens 6 --mode block'
    script = f"""
        export KVRAG_HOME={home}
        "$KVRAG" --device cpu --model {model_dir} index {notes} > /dev/null 2> {report}/err0
        {ask} > {report}/out1 2> {report}/err1
        find {home}/kv -name '*.safetensors' -size +4k -delete
        cat /dev/zero > {home}/kv/filler 2> /dev/null
        {ask} > {report}/out2 2> {report}/err2; echo $? > {report}/rc2
        find {home} -name '*.tmp' > {report}/tmp
    """
    on_small_disk(script, home / "kv", size="1m")
    read = lambda name: (report / name).read_text()  # noqa: E731
    assert read("out1").strip(), read("err0") + read("err1")
    assert read("rc2").strip() == "0" and read("out2") == read("out1"), read("err2")
    said = [line for line in lines(read("err2")) if line.startswith("kvrag:")]
    assert len(said) == 1 and f"no space left in {home / 'kv'}" in said[0], read("err2")
    assert "computed" in read("err2") and read("tmp") == ""
