"""Block-mode TTFT when the CPU is shared: thread policies x machine state, alternated in one run.

    python -m kvrag.eval.contention [--rounds 2] [--reps 3] [--policies defaults,passive,...]

Each policy runs in a child process of its own (OpenMP reads its environment once, when torch
loads it) that loads the default model, indexes ~4K tokens of passages and then times block-mode
requests (`max_new_tokens=1`) in segments. Between segments this process starts or stops another
process spinning on one core, so idle and busy alternate inside every child, and the policies take
turns round after round: a machine that drifts affects them alike. A segment during which other
processes used more than `--foreign` cores (from /proc/stat, less the child's and the spinner's
own time) is run again, up to `--retries` times; the table counts the segments it kept and marks
with * the rows that had to keep a contaminated one. Prints one table of medians.
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
RAW = {"OMP_NUM_THREADS", "OMP_WAIT_POLICY", "OMP_DYNAMIC", "OMP_PROC_BIND", "GOMP_SPINCOUNT", "KVRAG_KERNELS",
       "MKL_NUM_THREADS", "KVRAG_THREADS"}

# name: (environment of the child, whether kvrag is imported before torch so that kvrag's own thread set-up applies)
POLICIES = {
    "defaults": ({}, False),  # torch's and libgomp's defaults, as kvrag ran before it set any
    "passive": ({"OMP_WAIT_POLICY": "passive"}, False),
    "spin10k": ({"GOMP_SPINCOUNT": "10000"}, False),
    "spin1k": ({"GOMP_SPINCOUNT": "1000"}, False),
    "threads1": ({"OMP_NUM_THREADS": "1"}, False),
    "kernels0": ({"KVRAG_KERNELS": "0"}, False),
    "passive+kernels0": ({"OMP_WAIT_POLICY": "passive", "KVRAG_KERNELS": "0"}, False),
    "kvrag": ({}, True),  # whatever `import kvrag` now sets up, as a user gets it
    "kvrag+kernels0": ({"KVRAG_KERNELS": "0"}, True),
}
DEFAULT = "defaults,passive,spin10k,spin1k,threads1,kernels0,kvrag,kvrag+kernels0"


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


def child() -> None:
    """One policy's process: set up, say so, then time `reps` requests per line read ("quit" ends)."""
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
    _send(threads=torch.get_num_threads(), kernels=kernels.status(), prompt_tokens=result.prompt_tokens,
          omp=runtimes, env={k: os.environ[k] for k in sorted(RAW) if k in os.environ})
    for line in sys.stdin:
        if line.strip() == "quit":
            break
        _send(ttft=[ttft() for _ in range(int(line))])


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
        """For the spinner and the children alike: a negative value (root only) keeps a shared machine's
        other work from skewing both states, while the two compete with each other as equals."""
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


def segment(proc, log, spinner: Spinner, reps: int) -> tuple[list[float], float]:
    """`reps` request times, and the cores other processes kept busy meanwhile."""
    ours = [proc.pid] + ([spinner.proc.pid] if spinner.proc else [])
    before, wall = [cpu_seconds()] + [cpu_seconds(pid) for pid in ours], time.perf_counter()
    proc.stdin.write(f"{reps}\n")
    proc.stdin.flush()
    times = _receive(proc, log)["ttft"]
    after, wall = [cpu_seconds()] + [cpu_seconds(pid) for pid in ours], time.perf_counter() - wall
    machine, *own = (b - a for a, b in zip(before, after))
    return times, max(0.0, machine - sum(own)) / wall


def run_policy(name: str, args, spinner: Spinner, first: str) -> tuple[dict, dict[str, list[float]], int]:
    """Start the policy's child, alternate the machine state segment by segment from `first`;
    returns the child's set-up, the times kept per state and how many contaminated segments were kept."""
    env, kvrag_first = POLICIES[name]
    env = {**{k: v for k, v in os.environ.items() if k not in RAW}, **env}
    prelude = "" if kvrag_first else "import torch; "
    code = prelude + "from kvrag.eval.contention import child; child()"
    spec = json.dumps({"tokens": args.tokens, "passages": args.passages})
    times, contaminated = {"idle": [], "busy": []}, 0
    with tempfile.TemporaryFile("w+") as log:
        spinner.set(False)
        proc = subprocess.Popen([sys.executable, "-c", code, spec], env=env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=log, text=True,
                                preexec_fn=spinner.niceness)
        try:
            info = _receive(proc, log)
            states = ["idle", "busy"] if first == "idle" else ["busy", "idle"]
            for i in range(2 * args.segments):
                state = states[i % 2]
                spinner.set(state == "busy")
                for attempt in range(args.retries + 1):
                    measured, foreign = segment(proc, log, spinner, args.reps)
                    if foreign <= args.foreign:
                        break
                    time.sleep(2)
                contaminated += foreign > args.foreign
                times[state] += measured
            proc.stdin.write("quit\n")
            proc.stdin.flush()
            proc.wait(timeout=60)
        finally:
            spinner.set(False)
            if proc.poll() is None:
                proc.kill()
    return info, times, contaminated


def table(results: dict, infos: dict, contaminated: dict) -> str:
    base = statistics.median(results["defaults"]["idle"]) if "defaults" in results else None
    lines = [f"{'policy':<18} {'threads':>7} {'kernels':<9} {'idle s':>7} {'busy s':>7} {'busy/idle':>9} "
             f"{'idle/defaults idle':>18} {'n':>5}  env"]
    for name, times in results.items():
        idle, busy = statistics.median(times["idle"]), statistics.median(times["busy"])
        info = infos[name]
        kernels = "on" if info["kernels"].startswith("on") else "off"
        versus = f"{idle / base:.2f}x" if base else "-"
        env = " ".join(f"{k}={v}" for k, v in info["env"].items()) or "-"
        mark = "*" if contaminated[name] else " "
        lines.append(f"{name + mark:<18} {info['threads']:>7} {kernels:<9} {idle:>7.3f} {busy:>7.3f} {busy / idle:>8.2f}x "
                     f"{versus:>18} {len(times['idle']):>2}+{len(times['busy']):<2}  {env}")
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
    build = subprocess.run([sys.executable, "-c", "from kvrag import kernels; print(kernels.build())"],
                           capture_output=True, text=True)
    print(f"kernels: {build.stdout.strip() or build.stderr.strip()[-300:]}; cores: {os.cpu_count()}; "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    results = {name: {"idle": [], "busy": []} for name in names}
    infos, spinner, started = {}, Spinner(args.nice), time.perf_counter()
    contaminated = dict.fromkeys(names, 0)
    for round_ in range(args.rounds):
        for i in range(len(names)):
            name = names[(i + round_) % len(names)]
            first = "idle" if (i + round_) % 2 == 0 else "busy"
            infos[name], times, dirty = run_policy(name, args, spinner, first)
            contaminated[name] += dirty
            for state in times:
                results[name][state] += times[state]
            print(f"round {round_ + 1}/{args.rounds} {name:<18} idle {statistics.median(times['idle']):.3f} s, "
                  f"busy {statistics.median(times['busy']):.3f} s ({time.perf_counter() - started:.0f} s)", flush=True)
    prompt_tokens = {info["prompt_tokens"] for info in infos.values()}
    print(f"\nblock-mode TTFT, median seconds; prompt {'/'.join(map(str, sorted(prompt_tokens)))} tokens, "
          f"{args.passages} passages, max_new_tokens=1; busy = one `python -c '{SPIN}'` running; "
          f"load average at the end {os.getloadavg()[0]:.2f}")
    print(table(results, infos, contaminated))
    if any(contaminated.values()):
        print(f"* kept segments during which other processes used more than {args.foreign} cores: "
              + ", ".join(f"{name} {n}" for name, n in contaminated.items() if n))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "infos": infos, "results": results, "contaminated": contaminated}, f, indent=1)


if __name__ == "__main__":
    main()
