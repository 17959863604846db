"""The run of docs/layouts.md "How the rule is run" (a record, not part of kvrag). Fifth-stage rule on a lent GPU: train candidates A and B, answer the dev questions (and, if time is
left, SQuAD test for both candidates), in priority order, until the deadline; then pack the results."""
import json, os, pathlib, signal, subprocess, sys, tarfile, time

HERE = pathlib.Path(__file__).resolve().parent
DEV = os.environ.get("KV_DEVICE", "cuda")
T0 = time.time()
DEADLINE = T0 + float(os.environ["KV_BUDGET"])
CAP = int(os.environ.get("KV_WORKERS", "15"))
N_DEV, N_TEST = os.environ.get("KV_NDEV", "100"), os.environ.get("KV_NTEST", "150")
ROOT = pathlib.Path(os.environ.get("KV_WORK", "/tmp/w"))
OUT = pathlib.Path(os.environ.get("OUT", ROOT / "out"))
R, LOGS, HOMES = ROOT / "results", ROOT / "logs", ROOT / "homes"
for d in (R, LOGS, HOMES, OUT):
    d.mkdir(parents=True, exist_ok=True)
K = [sys.executable, str(HERE / "k.py"), "--device", DEV, "--dtype", "float32"]
SHIPPED = str(pathlib.Path("src/kvrag/adapters/smollm2-135m-instruct-block").resolve())
LAYOUTS = ["kvrag", "langchain-rag-prompt", "rag-prompt-question-last", "langchain-system-context",
           "llamaindex-text-qa", "llamaindex-chat-qa", "numbered", "separated"]
TRAIN = ["finetune", "--init-adapter", SHIPPED, "--steps", os.environ.get("KV_STEPS", "70"), "--lr", "3e-4",
         "--prompts", "all", "--prose", "0.5", "--blend-share", "0.5", "--squad-share", "0.5",
         "--full-attention-share", "0.25", "--seed", "5", "--init-seed", "5", "--unanswerable-share", "0.05",
         "--adapter-scale", "1.75"] + (["--questions", os.environ["KV_QUESTIONS"], "--accumulate", "1"]
                                        if "KV_QUESTIONS" in os.environ else [])
ADAPTER = {"shipped": SHIPPED, "A": str(ROOT / "A" / "adapter"), "B": str(ROOT / "B" / "adapter")}
trainers = {"A": TRAIN[:1] + [str(ROOT / "A")] + TRAIN[1:],
            "B": TRAIN[:1] + [str(ROOT / "B")] + TRAIN[1:] + ["--distill", "1.0"]}

jobs = []  # (name, adapter, bench args), in priority order
for ad in ("shipped", "A", "B"):
    for lay in LAYOUTS:
        jobs.append((f"squad-dev-{ad}-{lay}", ad, ["--squad", "--split", "dev", "--passages", "5", "--limit", N_DEV,
                                                  "--prompts", lay, "--methods", "full,block,blend"]))
for ad in ("A", "B", "shipped"):
    for world, extra in (("plain", []), ("prose", ["--prose", "1.0"])):
        for lay in LAYOUTS:
            jobs.append((f"gen-dev-{world}-{ad}-{lay}", ad, ["--split", "dev", "--limit", N_DEV, "--prompts", lay,
                                                            "--methods", "block,blend"] + extra))
for ad in ("A", "B"):
    for lay in LAYOUTS:
        jobs.append((f"squad-test-{ad}-{lay}", ad, ["--squad", "--split", "test", "--passages", "5", "--limit", N_TEST,
                                                   "--prompts", lay, "--methods", "full,block,blend"]))

status = {}
running = {}


def start(name, args):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    log = open(LOGS / f"{name}.log", "w")
    p = subprocess.Popen(K + ["--home", str(HOMES / name)] + args, stdout=log, stderr=subprocess.STDOUT, env=env,
                         start_new_session=True)
    running[name] = (p, time.time())
    status[name] = {"start": round(time.time() - T0, 1)}


def reap():
    for name, (p, t) in list(running.items()):
        if p.poll() is not None:
            status[name].update(rc=p.returncode, seconds=round(time.time() - t, 1))
            del running[name]


def lines(name):
    f = R / f"{name}.jsonl"
    return sum(1 for _ in open(f)) if f.exists() else 0


for ad, args in trainers.items():
    start(f"train-{ad}", args)
last = 0.0
while time.time() < DEADLINE:
    reap()
    ready = {"shipped": True, **{a: status.get(f"train-{a}", {}).get("rc") == 0 for a in ("A", "B")}}
    for job in list(jobs):
        if len(running) >= CAP:
            break
        name, ad, args = job
        if ready[ad]:
            jobs.remove(job)
            start(name, ["--adapter", ADAPTER[ad], "--adapter-scope", "all", "bench", "accuracy"] + args
                  + ["--results", str(R / f"{name}.jsonl")])
    failed = [a for a in ("A", "B") if status.get(f"train-{a}", {}).get("rc") not in (None, 0)]
    jobs = [j for j in jobs if j[1] not in failed]
    if not jobs and not running:
        break
    if time.time() - last > 30:
        last = time.time()
        done = sum(lines(n) for n in status if not n.startswith("train"))
        print(f"[{time.time() - T0:5.0f}s] running {len(running)}, queued {len(jobs)}, answers {done}", flush=True)
    time.sleep(1)

for name, (p, t) in running.items():
    os.killpg(p.pid, signal.SIGTERM)
time.sleep(3)
for name, (p, t) in running.items():
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
    status[name].update(rc="killed", seconds=round(time.time() - t, 1))
for name in status:
    if not name.startswith("train"):
        status[name]["answers"] = lines(name)
status["_"] = {"elapsed": round(time.time() - T0, 1), "queued": [j[0] for j in jobs], "device": DEV}
(OUT / "summary.json").write_text(json.dumps(status, indent=1))
with tarfile.open(OUT / "results.tar.gz", "w:gz") as t:
    t.add(R, "results")
with tarfile.open(OUT / "adapters.tar.gz", "w:gz") as t:
    for a in ("A", "B"):
        for f in ("adapter", "training.json"):
            if (ROOT / a / f).exists():
                t.add(ROOT / a / f, f"{a}/{f}")
with tarfile.open(OUT / "logs.tar.gz", "w:gz") as t:
    t.add(LOGS, "logs")
print(json.dumps(status["_"]), flush=True)
