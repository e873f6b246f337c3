"""Cold documents: wall time of a concurrent trace whose documents were never seen, per policy, side by side.

The trace: ``--clients`` clients send ``--clients`` x ``--requests`` requests, each client taking
the next one in trace order when its last is answered (:func:`benchmarks.replay.replay_in_order`); a request
holds the ten paragraphs of one HotpotQA example (each a chunk), a system prompt and its
question, and no two requests share an example, so every chunk is a miss (computed for the
first time) unless two examples happen to share a paragraph (the report counts the hits). This is
the cost a RAG service pays for documents it has not cached yet: ``pic`` computes each chunk
position-independently, a repair policy computes the same rows in the same forward (its query
pass) and then its repair pass (anchors, glue, query), ``full`` prefills everything causally.

After each policy's cold replay the same trace is replayed again, its chunks now cached (the
*warm* replay; ``--no-warm`` skips it). A repair policy's warm wall time minus ``pic``'s is the
repair's own cost; set beside its cold excess over ``pic`` it says how much of the cold cost is
the repair itself and how much the cold path adds.

Every policy replays the same trace on an emptied cache (``/flush_cache``), and the policies take
turns round after round in a rotated order, so drift on a shared machine hits them alike; the
figures are per-policy medians over the rounds and each round's ratio to ``pic`` (median).

    python -m benchmarks.bench_cold --quick
    python -m benchmarks.bench_cold                      # 4 clients x 8 requests, 3 rounds
"""

from __future__ import annotations

import argparse
import statistics

from benchmarks import common, quality_tasks
from benchmarks.replay import replay_in_order
from benchmarks.tables import markdown_table
from relaxkv_sglang.client import ServerClient
from relaxkv_sglang.repair.policies import Policy

BENCH = "bench_cold"


def make_trace(n_requests: int, offset: int) -> list[tuple[str, list[int]]]:
    """``n_requests`` prompts (text, chunk offsets), one HotpotQA dev example each from ``offset``."""
    examples = quality_tasks.task_examples("hotpotqa", n_requests, offset=offset)
    return [ex.marked("plain") for ex in examples]


def replay(client: ServerClient, trace: list[tuple[str, list[int]]], policy: str, clients: int,
           anchor_ratio: float | None, flush: bool = True) -> dict:
    """Flush (unless told not to), then send the trace from ``clients`` concurrent clients, in trace order."""
    if flush:
        client.flush()

    def one(i: int, _client: int, _sent_at: float) -> dict:
        text, offsets = trace[i]
        response = client.generate(text, offsets, policy, max_new_tokens=1, anchor_ratio=anchor_ratio)
        return common.relaxkv_report(response) | {"latency_s": response["client_latency_s"]}

    reports, wall = replay_in_order(one, len(trace), clients)
    return {
        "wall_s": wall,
        "chunks_seen": sum(r.get("chunks_seen", 0) for r in reports),
        "chunks_hit": sum(r.get("chunks_hit", 0) for r in reports),
        "repaired": sum(bool(r.get("repaired")) for r in reports),
        "median_latency_s": statistics.median(r["latency_s"] for r in reports),
    }


def anchor_ratio(args: argparse.Namespace, policy: str) -> float | None:
    """``--anchor-ratio`` for a repair policy (the policy registry says which); None otherwise."""
    return args.anchor_ratio if Policy(policy).repairs else None


def run(args: argparse.Namespace) -> dict:
    trace = make_trace(args.clients * args.requests, args.offset)
    rounds: list[dict[str, dict]] = []
    with common.bench_client(args, BENCH) as client:
        # Warm the server's code paths (not the documents: the replay flushes first).
        for policy in args.policies:
            replay(client, trace[:1], policy, 1, anchor_ratio(args, policy))
        for k in range(args.rounds):
            order = args.policies[k % len(args.policies):] + args.policies[:k % len(args.policies)]
            this_round = {}
            for policy in order:
                this_round[policy] = replay(client, trace, policy, args.clients, anchor_ratio(args, policy))
                line = f"round {k + 1}: {policy:<10} {this_round[policy]['wall_s']:6.1f} s"
                if args.warm:  # the same trace again, its chunks cached by the cold replay
                    this_round[policy]["warm"] = replay(client, trace, policy, args.clients, anchor_ratio(args, policy),
                                                        flush=False)
                    line += f"  (warm {this_round[policy]['warm']['wall_s']:6.1f} s)"
                print(line, flush=True)
            rounds.append(this_round)
    return {"requests": len(trace), "clients": args.clients, "rounds": rounds, "summary": summarize(rounds)}


def summarize(rounds: list[dict[str, dict]]) -> dict:
    """Per policy: median wall time over the rounds, and the median of each round's ratio to
    ``pic`` and excess over it (seconds), cold and, if replayed, warm."""
    summary = {}
    for policy in rounds[0]:
        walls = [r[policy]["wall_s"] for r in rounds]
        summary[policy] = {
            "median_wall_s": statistics.median(walls),
            "walls_s": walls,
            "median_ratio_to_pic": statistics.median(r[policy]["wall_s"] / r["pic"]["wall_s"] for r in rounds),
            "median_excess_over_pic_s": statistics.median(r[policy]["wall_s"] - r["pic"]["wall_s"] for r in rounds),
            "chunks_hit": rounds[-1][policy]["chunks_hit"],
            "chunks_seen": rounds[-1][policy]["chunks_seen"],
            "repaired": rounds[-1][policy]["repaired"],
        }
        if all("warm" in r[policy] and "warm" in r["pic"] for r in rounds):
            warm = [r[policy]["warm"]["wall_s"] for r in rounds]
            summary[policy] |= {
                "median_warm_wall_s": statistics.median(warm),
                "warm_walls_s": warm,
                "median_warm_excess_over_pic_s": statistics.median(
                    r[policy]["warm"]["wall_s"] - r["pic"]["warm"]["wall_s"] for r in rounds),
                "warm_chunks_hit": rounds[-1][policy]["warm"]["chunks_hit"],
            }
    return summary


def print_table(result: dict) -> None:
    print(f"\ncold trace: {result['requests']} requests, {result['clients']} clients; medians over "
          f"{len(result['rounds'])} rounds")
    print("\n".join(markdown_table(
        ["policy", "wall s", "x pic", "over pic s", "warm wall s", "warm over pic s", "chunk hits / seen", "repaired"],
        [[policy, f"{s['median_wall_s']:.1f}", common.fmt(s["median_ratio_to_pic"], ".2f"),
          f"{s['median_excess_over_pic_s']:+.1f}", common.fmt(s.get("median_warm_wall_s"), ".1f"),
          common.fmt(s.get("median_warm_excess_over_pic_s"), "+.1f"), f"{s['chunks_hit']} / {s['chunks_seen']}",
          str(s["repaired"])] for policy, s in result["summary"].items()])))


def main(argv: list[str] | None = None) -> None:
    parser = common.bench_parser(BENCH, __doc__, quick_help="2 clients x 2 requests, 1 round")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--requests", type=int, default=8, help="requests per client")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--policies", nargs="+", default=["full", "pic", "relaxkv"])
    parser.add_argument("--anchor-ratio", type=float, default=0.15, help="anchor ratio of the repair policies")
    parser.add_argument("--offset", type=int, default=1000, help="first HotpotQA dev example")
    parser.add_argument("--no-warm", dest="warm", action="store_false",
                        help="skip the warm replay (the same trace again, its chunks cached) after each cold one")
    args = common.parse_args(parser, argv, quick={"clients": 2, "requests": 2, "rounds": 1})
    if args.clients < 1 or args.requests < 1 or args.rounds < 1:
        common.fail(BENCH, "--clients, --requests and --rounds must be >= 1")
    if "pic" not in args.policies:
        common.fail(BENCH, "--policies must include pic (the figures are ratios to it)")
    common.run_bench(BENCH, args, run, report=print_table)


if __name__ == "__main__":
    main()
