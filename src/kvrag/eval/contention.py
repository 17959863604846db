"""Block-mode TTFT when the CPU is shared: thread policies x machine state, alternated in one run.

    python -m kvrag.eval.contention [--rounds 2] [--reps 3] [--policies plain,passive,...]

Each policy runs in a child process of its own (OpenMP reads its environment once, when torch
loads it) that loads the default model, indexes ~4K tokens of passages and then times block-mode
requests (`max_new_tokens=1`) through the public API, in segments. Between segments this process
starts or stops another process spinning on one core, so idle and busy alternate inside every
child, and the policies take turns round after round: a machine that drifts affects them alike.
A segment during which other processes used more than `--foreign` cores (from /proc/stat, less the
child's and the spinner's own time) is run again, up to `--retries` times; rows that had to keep
such a segment are marked *. On a machine shared with other work, `--nice -10` (root) keeps that
work from skewing both states, while the child and the spinner still compete as equals.
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

QUESTION = (
    "Which engineer designed the northern lighthouse of the island, in what year was it finished, "
    "and what was its lantern room made of?"
)
FILLERS = (
    "The archive of the harbour office records ships, cargo, weather and the names of the pilots who guided them. ",
    "Each entry lists the date, the tide, the berth and the fee that was paid by the master of the vessel. ",
    "In winter the ferry to the mainland runs twice a week, and the post arrives with it in sealed canvas bags. ",
    "The town council meets in the old customs house, whose clock was brought from the mainland in a fishing boat. ",
)
SPIN = "while 1: pass"
SETTINGS = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "OMP_DYNAMIC", "OMP_PROC_BIND", "GOMP_SPINCOUNT", "KVRAG_KERNELS",
            "MKL_NUM_THREADS")

# name: (environment, whether kvrag's own thread handling applies). Without it ("plain"), torch is
# imported before kvrag, so kvrag's environment defaults come too late, and OMP_NUM_THREADS is set
# (to torch's own count unless the policy names one), which turns kvrag's per-request count off:
# torch's and libgomp's defaults, as kvrag ran before it had a thread policy.
POLICIES = {
    "plain": ({}, False),
    "passive": ({"OMP_WAIT_POLICY": "passive"}, False),
    "spin3k": ({"GOMP_SPINCOUNT": "3000"}, False),
    "spin1k": ({"GOMP_SPINCOUNT": "1000"}, False),
    "leave-one": ({"OMP_NUM_THREADS": "-1"}, False),  # a core left free: one thread fewer than torch's default
    "plain+kernels0": ({"KVRAG_KERNELS": "0"}, False),
    "kvrag": ({}, True),  # what `import kvrag` and its requests now do, as a user gets them
    "kvrag+kernels0": ({"KVRAG_KERNELS": "0"}, True),
}
DEFAULT = "plain,passive,leave-one,plain+kernels0,kvrag,kvrag+kernels0"


def make_passages(tokenizer, tokens: int, count: int) -> list[str]:
    """`count` distinct filler passages of about tokens / count tokens each."""
    per, passages = tokens // count, []
    for i in range(count):
        text, k = f"Record {i}. ", i
        while len(tokenizer(text, add_special_tokens=False).input_ids) < per:
            text += FILLERS[k % len(FILLERS)]
            k += 1
        passages.append(text)
    return passages


def child(env: dict) -> None:
    """One policy's process: set up, say so, then time `reps` requests per line read ("quit" ends).
    `env`: the settings OpenMP read when torch was loaded."""
    import torch

    from kvrag import KVEngine, kernels

    spec = json.loads(sys.argv[1])
    engine = KVEngine.from_pretrained()
    passages = make_passages(engine.tokenizer, spec["tokens"], spec["passages"])
    engine.index(passages)

    def ttft() -> float:
        return engine.generate(QUESTION, passages, mode="block", max_new_tokens=1).ttft

    for _ in range(2):  # warm-up: buffers, allocator, stored blocks in memory
        result = engine.generate(QUESTION, passages, mode="block", max_new_tokens=1)
    runtimes = sorted({line.split()[-1] for line in open("/proc/self/maps") if "libgomp" in line or "libiomp" in line})
    _send(kernels=kernels.status(), prompt_tokens=result.prompt_tokens, omp=runtimes,
          env={k: env[k] for k in SETTINGS if k in env})
    for line in sys.stdin:
        if line.strip() == "quit":
            break
        _send(ttft=[ttft() for _ in range(int(line))], threads=torch.get_num_threads())


def _send(**message) -> None:
    print("@@" + json.dumps(message), flush=True)


def _receive(proc, log) -> dict:
    for line in proc.stdout:
        if line.startswith("@@"):
            return json.loads(line[2:])
    log.seek(0)
    raise RuntimeError(f"the child stopped (exit {proc.wait()}):\n{log.read()[-3000:]}")


def cpu_seconds(pid: int | None = None) -> float:
    """CPU time used by the whole machine (busy, not idle) or by one process."""
    tick = os.sysconf("SC_CLK_TCK")
    if pid is None:
        fields = [int(x) for x in open("/proc/stat").readline().split()[1:]]
        return (sum(fields[:8]) - fields[3] - fields[4]) / tick  # all but idle and iowait
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / tick  # utime + stime


class Spinner:
    """Another process keeping one core busy while it runs."""

    def __init__(self, nice: int = 0):
        self.proc, self.nice = None, nice

    def niceness(self) -> None:
        """For the spinner and the children alike."""
        if self.nice:
            os.setpriority(os.PRIO_PROCESS, 0, self.nice)

    def set(self, busy: bool) -> None:
        if busy and self.proc is None:
            self.proc = subprocess.Popen([sys.executable, "-c", SPIN], preexec_fn=self.niceness)
            time.sleep(0.5)  # past its start-up: spinning
        elif not busy and self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
            time.sleep(0.2)


def segment(proc, log, spinner: Spinner, reps: int) -> tuple[dict, float]:
    """The child's answer for `reps` requests, and the cores other processes kept busy meanwhile."""
    ours = [proc.pid] + ([spinner.proc.pid] if spinner.proc else [])
    before, wall = [cpu_seconds()] + [cpu_seconds(pid) for pid in ours], time.perf_counter()
    proc.stdin.write(f"{reps}\n")
    proc.stdin.flush()
    answer = _receive(proc, log)
    after, wall = [cpu_seconds()] + [cpu_seconds(pid) for pid in ours], time.perf_counter() - wall
    machine, *own = (b - a for a, b in zip(before, after))
    return answer, max(0.0, machine - sum(own)) / wall


def policy_env(name: str, torch_threads: int) -> tuple[dict, str]:
    """The child's environment and the code it runs."""
    env, kvrag_first = POLICIES[name]
    env = {**{k: v for k, v in os.environ.items() if k not in SETTINGS}, **env}
    if not kvrag_first:
        count = int(env.get("OMP_NUM_THREADS", "0"))
        env["OMP_NUM_THREADS"] = str(max(1, torch_threads + count) if count <= 0 else count)
    first = "" if kvrag_first else "import torch; "
    return env, f"import os; env = dict(os.environ); {first}from kvrag.eval.contention import child; child(env)"


def run_policy(name: str, args, spinner: Spinner, first: str, torch_threads: int) -> tuple[dict, dict, int]:
    """Start the policy's child, alternate the machine state segment by segment from `first`; returns
    the child's set-up, the times and thread counts per state, and how many contaminated segments were kept."""
    env, code = policy_env(name, torch_threads)
    spec = json.dumps({"tokens": args.tokens, "passages": args.passages})
    times, contaminated = {"idle": [], "busy": [], "idle threads": set(), "busy threads": set()}, 0
    with tempfile.TemporaryFile("w+") as log:
        spinner.set(False)
        proc = subprocess.Popen([sys.executable, "-c", code, spec], env=env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=log, text=True, preexec_fn=spinner.niceness)
        try:
            info = _receive(proc, log)
            states = ["idle", "busy"] if first == "idle" else ["busy", "idle"]
            for i in range(2 * args.segments):
                state = states[i % 2]
                spinner.set(state == "busy")
                for _ in range(args.retries + 1):
                    answer, foreign = segment(proc, log, spinner, args.reps)
                    if foreign <= args.foreign:
                        break
                    time.sleep(2)
                contaminated += foreign > args.foreign
                times[state] += answer["ttft"]
                times[f"{state} threads"].add(answer["threads"])
            proc.stdin.write("quit\n")
            proc.stdin.flush()
            proc.wait(timeout=60)
        finally:
            spinner.set(False)
            if proc.poll() is None:
                proc.kill()
    return info, times, contaminated


def table(results: dict, infos: dict, contaminated: dict) -> str:
    base = statistics.median(results["plain"]["idle"]) if "plain" in results else None
    lines = [f"{'policy':<16} {'threads':>7} {'kernels':<7} {'idle s':>7} {'busy s':>7} {'busy/idle':>9} "
             f"{'idle/plain idle':>15} {'n':>5}  environment"]
    for name, times in results.items():
        idle, busy = statistics.median(times["idle"]), statistics.median(times["busy"])
        info = infos[name]
        threads = "/".join(",".join(map(str, sorted(times[f"{s} threads"]))) for s in ("idle", "busy"))
        kernels = "on" if info["kernels"].startswith("on") else "off"
        versus = f"{idle / base:.2f}x" if base else "-"
        env = " ".join(f"{k}={v}" for k, v in info["env"].items()) or "-"
        mark = "*" if contaminated[name] else " "
        lines.append(f"{name + mark:<16} {threads:>7} {kernels:<7} {idle:>7.3f} {busy:>7.3f} {busy / idle:>8.2f}x "
                     f"{versus:>15} {len(times['idle']):>2}+{len(times['busy']):<2}  {env}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvrag.eval.contention", description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", default=DEFAULT, help=f"comma-separated, of: {', '.join(POLICIES)}")
    parser.add_argument("--rounds", type=int, default=2, help="children per policy, taking turns with the others")
    parser.add_argument("--segments", type=int, default=2, help="idle and busy segments per child, alternated")
    parser.add_argument("--reps", type=int, default=3, help="requests per segment")
    parser.add_argument("--tokens", type=int, default=3700, help="passage tokens (the prompt has ~4K with the template's)")
    parser.add_argument("--passages", type=int, default=26)
    parser.add_argument("--foreign", type=float, default=0.3, help="other processes' cores above which a segment is rerun")
    parser.add_argument("--retries", type=int, default=2, help="reruns of a contaminated segment")
    parser.add_argument("--nice", type=int, default=0, help="priority of the children and the spinner (negative: root only)")
    parser.add_argument("--json", help="also write every time measured to this file")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # through the `finally`s that stop the spinner and children
    names = args.policies.split(",")
    if unknown := set(names) - set(POLICIES):
        parser.error(f"unknown policies {sorted(unknown)}; known: {', '.join(POLICIES)}")
    plain = {k: v for k, v in os.environ.items() if k not in SETTINGS}
    probe = "import torch; from kvrag import kernels; print(torch.get_num_threads()); print(kernels.build())"
    setup = subprocess.run([sys.executable, "-c", probe], env=plain, capture_output=True, text=True, check=True)
    torch_threads, built = setup.stdout.split("\n", 1)
    torch_threads = int(torch_threads)
    print(f"kernels: {built.strip()}; torch's threads: {torch_threads}; CPUs: {len(os.sched_getaffinity(0))}; "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    results = {name: {"idle": [], "busy": [], "idle threads": set(), "busy threads": set()} for name in names}
    infos, spinner, started = {}, Spinner(args.nice), time.perf_counter()
    contaminated = dict.fromkeys(names, 0)
    for round_ in range(args.rounds):
        for i in range(len(names)):
            name = names[(i + round_) % len(names)]
            first = "idle" if (i + round_) % 2 == 0 else "busy"
            infos[name], times, dirty = run_policy(name, args, spinner, first, torch_threads)
            contaminated[name] += dirty
            for state in ("idle", "busy"):
                results[name][state] += times[state]
                results[name][f"{state} threads"] |= times[f"{state} threads"]
            print(f"round {round_ + 1}/{args.rounds} {name:<16} idle {statistics.median(times['idle']):.3f} s, "
                  f"busy {statistics.median(times['busy']):.3f} s ({time.perf_counter() - started:.0f} s)", flush=True)
    prompt_tokens = sorted({info["prompt_tokens"] for info in infos.values()})
    print(f"\nblock-mode TTFT, median seconds; prompt {'/'.join(map(str, prompt_tokens))} tokens, {args.passages} "
          f"passages, max_new_tokens=1; busy: one `python -c '{SPIN}'` running; threads: idle/busy; "
          f"load average at the end {os.getloadavg()[0]:.2f}")
    print(table(results, infos, contaminated))
    if any(contaminated.values()):
        print(f"* kept segments during which other processes used more than {args.foreign} cores: "
              + ", ".join(f"{name} {n}" for name, n in contaminated.items() if n))
    if args.json:
        with open(args.json, "w") as f:
            dump = {name: {k: sorted(v) if isinstance(v, set) else v for k, v in r.items()} for name, r in results.items()}
            json.dump({"args": vars(args), "infos": infos, "results": dump, "contaminated": contaminated}, f, indent=1)


if __name__ == "__main__":
    main()
