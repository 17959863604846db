"""Several `kvrag index` processes on one fresh home, and a garbage embedded Chroma, through the real
command line on a tiny saved model: the processes share the work (each unique passage encoded once, by
one of them), none crashes on the stores' first use, and a damaged Chroma is moved aside with one
warning line, the CLI's collection rebuilt from the passage registry."""

import hashlib
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

from transformers import AutoTokenizer

from kvrag.app.cli import common
from kvrag.retrieval import DEFAULT_COLLECTION, PassageIndex, chroma_collection
from kvrag.match import registered_passages
from kvrag.prompt import PromptLayout

KVRAG = str(Path(sys.executable).with_name("kvrag"))
WORKERS = 4

FACTS = [
    "The lighthouse of Varnholm was built in 1873 by the engineer Ilsa Brandt, who lived beside it for forty years.",
    "The river Olm freezes every winter, and the ferry between its two banks stops until the ice breaks in spring.",
    "Saltmere is the capital of Orvanne and its largest harbour town, with a fish market that opens before dawn.",
    "The clock tower of Saltmere strikes thirteen times at noon, a custom kept since a storm broke its gears.",
    "Maren Solvik drew the first map of the northern islands in 1790, sailing alone in a boat she built herself.",
    "The Glimmerhook caves hold blue glowing worms that light the ceiling like stars on a moonless night sky.",
    "Every autumn the town of Brinn holds a race of wooden boats, and the winner keeps a copper bell for a year.",
    "The old mill on the river Olm ground barley for three villages until a flood carried its wheel away.",
    "Orvanne's parliament meets in a round hall of grey stone, so that no member may sit at the head of it.",
    "The island of Kesk has no trees at all, and its houses are built of turf cut from the hills in summer.",
    "A bridge of ropes crosses the gorge at Tarn, and only four people at a time are allowed to walk on it.",
    "The bakers of Saltmere make a black rye loaf with caraway seeds that keeps for a whole month at sea.",
    "The observatory on Mount Heid was founded by Ilsa Brandt's daughter, who catalogued nine hundred stars.",
    "Wild ponies roam the dunes of the southern coast, and nobody on Orvanne remembers who brought them there.",
    "The harbour of Brinn silted up in 1902, so the fishing fleet moved to Saltmere and never came back.",
]
FILES = {f"{name}.md": "\n\n".join(FACTS[4 * i : 4 * i + 4]) for i, name in enumerate("abcd")}
FILES["d.md"] += "\n\n" + FACTS[0]  # one paragraph in two files: a passage to encode once all the same

# An indexer as a user runs it (the CLI's own main), with every block Blocks.encode_many encodes written to a log,
# started together and reaching `KVEngine.index` together, so that a process that did not share the work
# would encode what the others are encoding. An encoding takes a moment, as a real model's does. With
# `die` N > 0 the process dies in its N-th encoding, its claims held (a shared tier's expire in 2 s).
INDEXER = """
import os, sys, time
from pathlib import Path
from kvrag import KVEngine, engine, remote
from kvrag.app.cli import main
from kvrag.assemble import Blocks

log, gate, workers, die = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
remote.CLAIM_SECONDS = 2.0
engine.PACK_TOKENS_CPU = int(os.environ.get("PACK_TOKENS", engine.PACK_TOKENS_CPU))

def meet(name):
    (gate / f"{name}-{os.getpid()}").touch()
    deadline = time.monotonic() + 300
    while len(list(gate.glob(f"{name}-*"))) < workers and time.monotonic() < deadline:
        time.sleep(0.01)

encode_many = Blocks.encode_many
def counted(self, ids_list, *args, **kwargs):
    for ids in ids_list:
        with open(log, "a") as f:
            f.write(f"{os.getpid()}:{' '.join(map(str, ids))}\\n")
        if die and sum(1 for _ in open(log)) >= die:
            os._exit(3)
    time.sleep(0.1)
    return encode_many(self, ids_list, *args, **kwargs)
Blocks.encode_many = counted

index = KVEngine.index
def together(self, *args, **kwargs):
    meet("index")
    return index(self, *args, **kwargs)
KVEngine.index = together

meet("start")
sys.exit(main(sys.argv[5:]))
"""


def _write_docs(root: Path) -> list[Path]:
    root.mkdir()
    for name, text in FILES.items():
        (root / name).write_text(text)
    return [root / name for name in FILES]


def _expected(model_dir: Path, files: list[Path]) -> tuple[list[str], PromptLayout]:
    """The unique passages the CLI cuts from `files`, and the prompt layout it encodes them with."""
    layout = PromptLayout(AutoTokenizer.from_pretrained(model_dir))
    passages, _ = common.passages(layout.encode, {f: f.read_text() for f in files}, 200)
    return list(dict.fromkeys(passages)), layout


def _env(home: Path) -> dict:
    return {**os.environ, "KVRAG_HOME": str(home), "OMP_NUM_THREADS": "1", "KVRAG_CHROMA": "",
            "KVRAG_REMOTE": "", "TOKENIZERS_PARALLELISM": "false",
            "PACK_TOKENS": "64"}  # the indexer's groups: two or three of these passages, not the whole corpus


def _kvrag(model_dir: Path, home: Path, *argv) -> subprocess.CompletedProcess:
    args = [KVRAG, "--model", str(model_dir), "--adapter", "none", "--device", "cpu", "--home", str(home), *argv]
    return subprocess.run(args, capture_output=True, text=True, timeout=600, env=_env(home))


def test_concurrent_indexers_on_a_fresh_home_share_the_work(saved_model_and_adapter, tmp_path):
    model_dir, _ = saved_model_and_adapter
    files = _write_docs(tmp_path / "docs")
    home, log, gate = tmp_path / "home", tmp_path / "encodings.log", tmp_path / "gate"
    gate.mkdir()
    procs = []
    for i in range(WORKERS):  # each its own order of the files, all of them
        order = files[i:] + files[:i]
        argv = ["--model", str(model_dir), "--adapter", "none", "--device", "cpu", "--home", str(home),
                "index", *map(str, order)]
        procs.append(subprocess.Popen([sys.executable, "-c", INDEXER, str(log), str(gate), str(WORKERS), "0", *argv],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(home)))
    outputs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outputs):
        assert p.returncode == 0 and "Traceback" not in err, err[-3000:]
        assert out.startswith(f"indexed {len(FACTS) + 1} passages from {len(FILES)} files"), out

    passages, layout = _expected(model_dir, files)
    assert len(passages) == len(FACTS)
    pids, encoded = zip(*(line.split(":") for line in log.read_text().splitlines()))
    blocks = [layout.prefix_ids, layout.separator_ids, *map(layout.passage_ids, passages)]
    assert sorted(Counter(encoded).values()) == [1] * len(blocks)  # nothing encoded twice, by any process
    assert set(encoded) == {" ".join(map(str, ids)) for ids in blocks}
    assert len(set(pids)) > 1  # the work was shared (each starts on a file of its own)

    stored = chroma_collection(home / "chroma", DEFAULT_COLLECTION).get()
    assert sorted(stored["documents"]) == sorted(passages)
    registries = sorted((home / "kv").glob("*/passages.sqlite"))
    assert len(registries) == 1 and sorted(registered_passages(registries)) == sorted(passages)
    claims = registries[0].parent / "claims"
    assert not list(claims.iterdir())  # every claim file removed once its block was stored
    digests = {f.name.removesuffix(".safetensors") for f in registries[0].parent.glob("??/*.safetensors")}
    assert len(digests) == len(blocks)


def _damage(home: Path) -> None:
    (home / "chroma" / "chroma.sqlite3").write_bytes(hashlib.sha256(b"garbage").digest() * 512)


def _damage_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if "chroma.sqlite3" in line]


def test_indexers_on_two_machines_share_the_work_through_redis_and_one_killed_loses_nothing(saved_model_and_adapter,
                                                                                           tmp_path):
    """Two homes (two machines' disks), one Redis: each block is encoded by one of them; one dies holding the
    claim of its third block, the other takes it over once it expires and finishes; a third machine then
    finds every block in the shared tier and encodes nothing."""
    from kvrag.eval.scaleout import RedisServer

    model_dir, _ = saved_model_and_adapter
    files = _write_docs(tmp_path / "docs")
    model = ["--model", str(model_dir), "--adapter", "none", "--device", "cpu"]
    with RedisServer(tmp_path / "redis") as redis:

        def indexer(name, workers, die, order):
            home, gate = tmp_path / name, tmp_path / f"gate-{workers}"
            gate.mkdir(exist_ok=True)
            # one passage per forward: a worker packing the whole corpus into one group would leave the other
            # nothing to die on (packed claims are tested on one machine above)
            env = {**_env(home), "KVRAG_REMOTE": redis.url, "KVRAG_SECRET": "the indexers' shared secret",
                   "PACK_TOKENS": "0"}
            argv = [*model, "--home", str(home), "index", *map(str, order)]
            return subprocess.Popen([sys.executable, "-c", INDEXER, str(tmp_path / f"{name}.log"), str(gate),
                                     str(workers), str(die), *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, env=env)

        dying, surviving = indexer("a", 2, 3, files), indexer("b", 2, 0, files[2:] + files[:2])
        assert dying.wait(timeout=600) == 3
        out, err = surviving.communicate(timeout=600)
        assert surviving.returncode == 0 and "Traceback" not in err, err[-3000:]
        passages, layout = _expected(model_dir, files)
        blocks = {" ".join(map(str, ids)) for ids in [layout.prefix_ids, layout.separator_ids,
                                                      *map(layout.passage_ids, passages)]}
        died_on = (tmp_path / "a.log").read_text().splitlines()[-1].split(":")[1]
        encoded = Counter(line.split(":")[1] for name in "ab" for line in (tmp_path / f"{name}.log").read_text().splitlines())
        assert set(encoded) == blocks
        assert all(n == 1 for block, n in encoded.items() if block != died_on) and encoded[died_on] == 2
        third = indexer("c", 1, 0, files)
        out, err = third.communicate(timeout=600)
        assert third.returncode == 0 and out.startswith(f"indexed {len(FACTS) + 1} passages"), err[-3000:]
        assert not (tmp_path / "c.log").exists()  # every block found in the shared tier


def test_a_garbage_chroma_is_moved_aside_and_the_cli_collection_rebuilt(saved_model_and_adapter, tmp_path):
    from chromadb.api.shared_system_client import SharedSystemClient

    model_dir, _ = saved_model_and_adapter
    files = _write_docs(tmp_path / "docs")
    home = tmp_path / "home"
    passages, _ = _expected(model_dir, files)
    question = "Who built the lighthouse of Varnholm?"
    assert _kvrag(model_dir, home, "index", str(tmp_path / "docs")).returncode == 0

    _damage(home)
    asked = _kvrag(model_dir, home, "ask", question, "--top-k", "2", "--max-new-tokens", "2", "--mode", "block")
    assert asked.returncode == 0 and "Traceback" not in asked.stderr, asked.stderr[-3000:]
    [line] = _damage_lines(asked.stderr)
    assert f"{home / 'chroma' / 'chroma.sqlite3'} is unusable" in line and "chroma.damaged-" in line, line
    assert f"{len(passages)} passages recovered" in line, line
    assert "[block] TTFT" in asked.stderr
    stored = chroma_collection(home / "chroma", DEFAULT_COLLECTION).get()
    assert sorted(stored["documents"]) == sorted(passages)
    assert {m["source"] for m in stored["metadatas"]} == {"recovered"}
    assert PassageIndex(home / "chroma").search(question, k=1) == [FACTS[0]]
    SharedSystemClient._identifier_to_system.pop(str(home / "chroma")).stop()  # as a new process: no cached store

    _damage(home)
    indexed = _kvrag(model_dir, home, "index", str(tmp_path / "docs"))
    assert indexed.returncode == 0 and "Traceback" not in indexed.stderr, indexed.stderr[-3000:]
    assert len(_damage_lines(indexed.stderr)) == 1
    again = _kvrag(model_dir, home, "ask", question, "--top-k", "2", "--max-new-tokens", "2")
    assert again.returncode == 0 and _damage_lines(again.stderr) == [], again.stderr[-3000:]
    assert len(list(home.glob("chroma.damaged-*"))) == 2
    stored = chroma_collection(home / "chroma", DEFAULT_COLLECTION).get()
    assert sorted(stored["documents"]) == sorted(passages)
    assert {m["source"] for m in stored["metadatas"]} == {str(f) for f in files}  # `index` stored the real ones
