"""Translated keys that stop matching the wrong chunk: a low-rank key correction fitted through the frozen target.

    python eval/fit_key_correction.py --target qwen2.5-0.5b --method bottleneck \\
        --lengths 1024 2048 --n 24 --rank 8 --epochs 4

`eval/results/length_diagnosis/FINDINGS.md` found that a translated needle is
read fine among native neighbours, but translated neighbours drown it, more so
the more of them there are: their keys match the question where they should
not. The translation lab's items hold one chunk each, so no fit so far has
seen that failure. This one does: each calibration needle is placed among the
other translated 256-token chunks of its window (4-8 chunks, as a query
places them), and per target layer l and KV head h a correction

    k' = k + (k A[l,h]) B[l,h]        (A: D×r, B: r×D, on position-free keys)

of every translated context key is learned by minimising the gold answer's
teacher-forced NLL through the frozen target (MoT's context correction,
applied to lookups among distractors). B starts at zero, so the fit starts
from the shipped map. `--export` adds A and B to the shipped bottleneck artifact
(`mappers/bottleneck.py` applies them after the map: 196 KB for Qwen2.5 at r = 8,
and 4·r·D multiply-adds per key, nothing beside the map's own cost).

Material: needles planted in the lab's **training** essays (seeds 700 +
length; `eval/diagnose_length.py` tests on the held-out essays, seeds 300 +
length). The last quarter of the items is held out of the fit and picks the
epoch. Writes OUT/<source>__<target>__<method>.safetensors (A, B) and .json
(history, command, host). `eval/diagnose_length.py --key-correction FILE`
measures it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cag.context import CachedContext  # noqa: E402
from mappers.bottleneck import corrected_keys  # noqa: E402  (the runtime's own correction)

SEED_BASE = 700  # calib-needle seeds of this fit only (diagnosis 300, context mass 500)


def training_needles(length: int, n: int, tokenizer) -> list:
    """`n` calibration needles in windows of about `length` target tokens of the lab's training essays."""
    from eval.diagnose_length import needles
    from eval.lab.data import training_essays

    return needles(length, n, tokenizer, seed_base=SEED_BASE, essays=training_essays())


@torch.no_grad()  # not inference_mode: the fit backpropagates through these keys
def translated_context(ctx: CachedContext, item) -> dict:
    """Position-free K/V ``[L, H, T, D]`` of prompt head + the item's translated chunks, in order."""
    from eval.diagnose_length import translated_chunks

    _, _, asm = ctx._ready()
    chunks, _ = translated_chunks(ctx, item)
    prefix = asm.prefix()
    return {"keys": torch.cat([prefix.keys, *[c.keys for c in chunks]], 2).float(),
            "values": torch.cat([prefix.values, *[c.values for c in chunks]], 2).float(),
            "n_prefix": prefix.num_tokens, "question": item.question, "answer": item.answers[0]}


def answer_nll(lm, asm, placed: dict, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    keys, n = placed["keys"], placed["n_prefix"]
    keys = torch.cat([keys[:, :, :n], corrected_keys(keys[:, :, n:], a, b)], 2)   # the prompt head stays native
    rotated = lm.adapter.rotate(keys.to(lm.dtype), torch.arange(keys.shape[2]))
    cache = lm.adapter.fill_cache(rotated, placed["values"].to(lm.dtype))
    q = asm.question_ids(placed["question"])
    gold = lm.tokenize(placed["answer"] if asm.layout.chat else " " + placed["answer"])[0]
    hidden = lm.model.model(input_ids=torch.cat([q, gold[:-1]])[None], past_key_values=cache,
                            use_cache=True).last_hidden_state
    return torch.nn.functional.cross_entropy(lm.model.lm_head(hidden[0, -gold.numel():]).float(), gold)


def fit(lm, asm, train: list[dict], held: list[dict], *, rank: int, epochs: int, lr: float, l2: float,
        progress=None) -> tuple[torch.Tensor, torch.Tensor, list[dict]]:
    fp = lm.fingerprint
    d = train[0]["keys"].shape[-1]
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(fp.num_layers, fp.num_kv_heads, d, rank, generator=g) / d ** 0.5).requires_grad_(True)
    b = torch.zeros(fp.num_layers, fp.num_kv_heads, rank, d, requires_grad=True)
    opt = torch.optim.Adam([a, b], lr=lr)
    frozen = [(p, p.requires_grad) for p in lm.model.parameters()]
    for p, _ in frozen:
        p.requires_grad_(False)
    try:
        return _fit_loop(lm, asm, train, held, a, b, opt, g, epochs=epochs, l2=l2, progress=progress)
    finally:
        for p, flag in frozen:  # the caller's model is left as it was
            p.requires_grad_(flag)


def _fit_loop(lm, asm, train, held, a, b, opt, g, *, epochs: int, l2: float, progress):
    def held_nll() -> float:
        with torch.no_grad():
            return sum(float(answer_nll(lm, asm, p, a, b)) for p in held) / max(1, len(held))

    history = [{"epoch": 0, "held_nll": held_nll()}]            # the shipped map, B = 0
    best = (history[0]["held_nll"], 0, a.detach().clone(), b.detach().clone())
    for epoch in range(1, epochs + 1):
        total = 0.0
        for i in torch.randperm(len(train), generator=g).tolist():
            loss = answer_nll(lm, asm, train[i], a, b)
            opt.zero_grad()
            (loss + l2 * ((a @ b) ** 2).sum()).backward()
            opt.step()
            total += float(loss.detach())
            if progress is not None:
                progress.advance(1)
        # train NLL is the running mean while fitting; held NLL is after the epoch
        history.append({"epoch": epoch, "train_nll": total / len(train), "held_nll": held_nll()})
        if history[-1]["held_nll"] < best[0]:
            best = (history[-1]["held_nll"], epoch, a.detach().clone(), b.detach().clone())
    return best[2], best[3], history + [{"chosen_epoch": best[1]}]


def export(source: str, target: str, method: str, out: Path) -> int:
    """Add the fitted correction to the shipped artifact it was fitted on (same folder: it replaces it)."""
    from safetensors.torch import load_file

    from mappers.base import load_mapper

    stem = f"{source}__{target}__{method}"
    meta = json.loads((out / f"{stem}.json").read_text())
    weights = load_file(str(out / f"{stem}.safetensors"))
    folder = ROOT / "mappers" / "pretrained" / stem
    mapper = load_mapper(folder)
    if mapper.artifact_id != meta["mapper_artifact"]:
        raise SystemExit(f"{folder} is artifact {mapper.artifact_id}; the correction was fitted on "
                         f"{meta['mapper_artifact']}: fit it again")
    mapper.settings["key_correction_rank"] = int(meta["rank"])
    mapper.set_weights(**mapper.weights, key_a=weights["a"], key_b=weights["b"])
    mapper.fitted_on["key_correction"] = {k: meta[k] for k in ("command", "date", "host", "mapper_artifact", "rank",
                                                             "lengths", "n_per_length", "seed_base", "history")}
    # Lookup records were measured without the correction; they are measured again, not carried over.
    mapper.fidelity = {k: v for k, v in mapper.fidelity.items() if k not in ("lab_lookup", "lookup", "lookup_repair")}
    mapper.save(folder)
    print(f"{folder}: artifact {mapper.artifact_id} (was {meta['mapper_artifact']})")
    return 0


def record_lab(source: str, target: str, method: str, result_path: Path) -> int:
    """The lab's single-chunk lookup score of the shipped artifact, measured after the correction."""
    from mappers.base import Mapper, load_mapper, write_card

    folder = ROOT / "mappers" / "pretrained" / f"{source}__{target}__{method}"
    result = json.loads(result_path.read_text())
    artifact = load_mapper(folder).artifact_id
    if artifact not in result.get("describe", ""):
        raise SystemExit(f"{result_path} scored {result.get('describe')!r}, not artifact {artifact}")
    card = Mapper.read_card(folder)
    card.setdefault("fidelity", {})["lab_lookup"] = {
        **{k: result[k] for k in ("split", "n", "found", "native_found", "no_context_found", "gold_ll",
                                  "native_gold_ll", "no_context_gold_ll", "kl_native", "found_vs_native")},
        "variant": result["variant"], "measured": result["date"]}
    write_card(folder, card)
    print(f"{folder}: lab_lookup found {result['found']:.2f} (native {result['native_found']:.2f}), "
          f"gold LL {result['gold_ll']:.2f}")
    return 0


def main(argv=None) -> int:
    from cag.models import registry
    from cag.progress import Progress
    from eval.diagnose_length import measurement_context, pair_arguments
    from eval.harness import host_info

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    pair_arguments(ap, n=24, lengths=[1024, 2048])
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--l2", type=float, default=1e-3, help="penalty on the correction's size, ||A B||²")
    ap.add_argument("--out", type=Path, default=ROOT / "eval" / "results" / "key_correction")
    ap.add_argument("--export", action="store_true", help="write the fitted correction (OUT) into the shipped "
                    "artifact in mappers/pretrained instead of fitting; its lookup records are dropped, to be "
                    "measured again (eval/gate_fidelity.py, translation_lab.py run --variants shipped)")
    ap.add_argument("--record-lab", type=Path, metavar="RESULT", help="write a `translation_lab.py run --variants "
                    "shipped` result (eval/results/lab/...json) into the shipped card as its lab_lookup record")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    if args.export:
        return export(args.source, args.target, args.method, args.out)
    if args.record_lab:
        return record_lab(args.source, args.target, args.method, args.record_lab)

    lm = registry.load(args.target, "auto")
    items = [it for length in args.lengths for it in training_needles(length, args.n, lm.tokenizer)]
    ctx = measurement_context(items, args.out, args.source, args.target, args.method)
    _, mapper, asm = ctx._ready()
    with Progress("translating", total=len(items), unit="items", interval_s=20) as bar:
        placed = []
        for it in items:
            placed.append(translated_context(ctx, it))
            bar.advance(1)
    # Hold out every fourth item (all lengths represented) to choose the epoch.
    held = [p for i, p in enumerate(placed) if i % 4 == 3]
    train = [p for i, p in enumerate(placed) if i % 4 != 3]
    with Progress("key correction", total=args.epochs * len(train), unit="steps", interval_s=20) as bar:
        a, b, history = fit(lm, asm, train, held, rank=args.rank, epochs=args.epochs, lr=args.lr, l2=args.l2,
                            progress=bar)
    stem = f"{args.source}__{args.target}__{args.method}"   # not Path.with_suffix: "qwen2.5" has a dot
    save_file({"a": a.contiguous(), "b": b.contiguous()}, str(args.out / f"{stem}.safetensors"))
    meta = {"source": args.source, "target": args.target, "method": args.method,
            "mapper_artifact": getattr(mapper, "artifact_id", args.method), "rank": args.rank,
            "lengths": args.lengths, "n_per_length": args.n, "train_items": len(train), "held_items": len(held),
            "seed_base": SEED_BASE, "lr": args.lr, "l2": args.l2, "history": history,
            "command": " ".join(["python", *sys.argv]), "date": time.strftime("%Y-%m-%d %H:%M"),
            "host": host_info().get("cpu", "")}
    (args.out / f"{stem}.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(json.dumps(history))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
