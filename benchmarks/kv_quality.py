"""What a quantized K/V cache costs in quality: the mean KL divergence of the next-token
distribution against an f16 cache, for each cache type, edgeinfer and llama.cpp side by side.

    python benchmarks/kv_quality.py MODEL.gguf [-n 512] [--types q8_0 q4_0 q4_1 q5_0 q5_1 iq4_nl]

The text below (fixed, written for this script) is tokenized by the model (edgeinfer's
tokenizer, BOS first) and cut to n tokens; each engine evaluates those tokens once with an
f16 cache and once per type (K and V the same type), logits at every position, and reports
mean over positions of KL(p_f16 || p_type), plus how often the top token is unchanged.
llama.cpp runs with flash attention on (as it must for a quantized V) for every type,
f16 included, so its baseline is its own flash-attention f16; edgeinfer's f16 baseline is its
`--flash-attn on` run (llama.cpp's same order) by default, so each KL measures the types and
nothing else; `--baseline non-flash` takes edgeinfer's default f16 order instead. Issue #40's
quality target: edgeinfer's KL no worse than llama.cpp's for the same type on the same file.
"""
from __future__ import annotations

import argparse

import numpy as np

TEXT = """\
The lighthouse stood on a spit of rock at the mouth of the harbour, and for most of the year
nobody thought about it at all. Ships came and went, the fishing boats left before dawn and
returned in the afternoon, and the lamp turned every night whether anyone watched or not. The
keeper was a quiet man named Tomas who had inherited the post from his aunt. He kept a logbook
in which he wrote the weather, the ships he saw, and anything else that seemed worth a line:
a seal asleep on the landing stage, a crate of oranges washed up after a storm, the evening a
comet hung over the cliffs like a smudge of chalk.

In the spring of the year this story begins, the harbour council voted to replace the old lamp
with an automatic beacon. It would run on solar panels and batteries, it would need a visit
only twice a year, and it would cost less in ten years than the keeper's salary did in two.
Tomas read the letter twice, folded it into the back of the logbook, and went on with his work.
He oiled the gears, cleaned the lens, and repainted the iron railing on the gallery, as he did
every spring. If the council wanted to know why, he did not tell them.

The engineers arrived in June. There were three of them, two young women and an older man who
spent most of his time on the telephone. They measured the tower, photographed the lamp room,
and asked Tomas a great many questions about the wind. How strong did it blow in winter? From
which direction did the worst storms come? Had the salt ever stopped the clockwork? He answered
each question carefully and then, because they seemed genuinely interested, told them about the
night in 1987 when the power failed and he turned the lens by hand for nine hours, counting the
seconds aloud so that the flash would keep its proper rhythm.

Science has a way of rewarding patience. A chemist who weighs a sample a thousand times learns
more about her balance than about the sample, and that knowledge is what makes the next
measurement trustworthy. Astronomers who photographed the same patch of sky every clear night
for decades found variable stars, asteroids and, once, a supernova in a distant galaxy, not
because they were looking for any of these things but because they kept looking. The records
of tide gauges, rain gauges and thermometers, kept by people who often never saw the use made
of them, are now the backbone of our understanding of the climate.

By August the beacon was installed. It was a white cylinder the size of a dustbin, bolted to
the gallery beside the old lamp, and on its first night it flashed with a cold blue light that
the fishermen said made the harbour look like a hospital corridor. Tomas watched it from the
doorway of his cottage. At midnight he climbed the tower, wound the clockwork, and lit the old
lamp as well. For a week the two lights turned together, the warm one and the cold one, and
nobody in the town said anything about it. Then the council sent another letter.

He wrote back that the beacon was an excellent machine and that he had no complaint against
it. He wrote that the old lamp cost nothing to run except his time, which was his own to spend.
He wrote that in forty years the light had never failed, and that he would like to keep it that
way until somebody could tell him the beacon would never fail either. The council discussed his
letter at length and, in the end, did nothing, which is what councils usually do when a question
has no cheap answer. So both lights kept turning, and the logbook kept filling, one line a day.
"""


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def mean_kl(base: np.ndarray, other: np.ndarray) -> tuple[float, float]:
    """(mean KL(p_base || p_other) over rows, share of rows with the same top token)."""
    lp, lq = _log_softmax(base), _log_softmax(other)
    kl = (np.exp(lp) * (lp - lq)).sum(axis=-1)
    return float(kl.mean()), float((base.argmax(-1) == other.argmax(-1)).mean())


def edgeinfer_logits(path: str, tokens: list[int], t: str, threads: int, flash: str = "on",
                     decode: bool = False) -> np.ndarray:
    from edgeinfer.engine import Engine, EngineOptions
    from edgeinfer.loader import open_model

    engine = Engine(open_model(path), EngineOptions(n_ctx=len(tokens) + 8, threads=threads, gpu_layers=0,
                                                     cache_type_k=t, cache_type_v=t, flash_attn=flash))
    kv = engine.new_cache()
    n = len(tokens)
    if decode:  # one token a step, as llama.cpp's n_batch=1 below
        return np.stack([np.asarray(engine.forward(np.array([tok]), np.array([i]), kv)[-1], np.float32)
                         for i, tok in enumerate(tokens)])
    return np.asarray(engine.forward(np.array(tokens), np.arange(n), kv, logits_for=np.arange(n)), np.float32)


def llama_cpp_logits(path: str, tokens: list[int], t: str, threads: int, flash: str = "on",
                     decode: bool = False) -> np.ndarray:
    import llama_cpp

    from edgeinfer.kv.cache_types import GGML_TYPE_ID

    n = len(tokens)
    batch = 1 if decode else n
    model = llama_cpp.Llama(path, n_ctx=n + 8, n_batch=batch, n_ubatch=batch, n_threads=threads,
                            n_threads_batch=threads, logits_all=True, flash_attn=True, type_k=GGML_TYPE_ID[t],
                            type_v=GGML_TYPE_ID[t], verbose=False)
    model.eval(tokens)
    out = np.array(model.scores[:n], np.float32)
    model.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help=".gguf path")
    ap.add_argument("-n", "--n-tokens", type=int, default=512)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--types", nargs="+", default=["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl"])
    ap.add_argument("--baseline", choices=["flash", "non-flash"], default="flash",
                    help="edgeinfer's f16 baseline: -fa on (llama.cpp's order, default) or its default order")
    ap.add_argument("--decode", action="store_true",
                    help="every token as its own step (both engines), instead of one batch of n: the prompt "
                         "GEMMs' order is then out of the comparison")
    args = ap.parse_args()

    from edgeinfer.loader import open_model
    from edgeinfer.tokenizer import load_tokenizer

    tokens = load_tokenizer(open_model(args.model).gguf).tokenize(TEXT, add_special=True)
    if len(tokens) < args.n_tokens:
        raise SystemExit(f"the text is {len(tokens)} tokens for this model, fewer than -n {args.n_tokens}")
    tokens = [int(x) for x in tokens[:args.n_tokens]]
    engines = {"edgeinfer": edgeinfer_logits, "llama.cpp": llama_cpp_logits}
    flash = "on" if args.baseline == "flash" else "auto"
    base = {name: fn(args.model, tokens, "f16", args.threads, flash, args.decode) for name, fn in engines.items()}
    print(f"{args.model}: {len(tokens)} tokens; KL(f16 || type) per next-token distribution, "
          f"mean over positions; top-1 = same argmax as f16")
    print(f"(edgeinfer's f16 baseline: {'-fa on, llama.cpp' + chr(39) + 's flash order' if flash == 'on' else 'its default, non-flash order'};")
    print(" the last column: the largest logit difference between the two engines with that type)")
    print("\n| K/V | edgeinfer KL | llama.cpp KL | edgeinfer top-1 | llama.cpp top-1 | max abs diff |")
    print("|---|---|---|---|---|---|")
    for t in ["f16"] + args.types:
        logits = {name: base[name] if t == "f16" else fn(args.model, tokens, t, args.threads, flash, args.decode)
                  for name, fn in engines.items()}
        got = {name: mean_kl(base[name], x) for name, x in logits.items()}
        e, ll = got["edgeinfer"], got["llama.cpp"]
        diff = float(np.abs(logits["edgeinfer"] - logits["llama.cpp"]).max())
        print(f"| {t} | {e[0]:.6f} | {ll[0]:.6f} | {e[1]:.1%} | {ll[1]:.1%} | {diff:.3g} |", flush=True)


if __name__ == "__main__":
    main()
