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

``--token-rank R`` fits a token part with it: a rank-R change ``(f − f̄) U V + c`` per target layer of
the artifact's token residual (f: the target's own direct path of tokens t, t−1, ... on keys and values),
which is what copying a name or number out of the context reads. It has the residual's form, so
`--export` folds it into ``tok_w``/``tok_mean_r``. A fit on an artifact that already carries a key
correction continues it (A, B start there) instead of stacking a second one.

``--repair R --repair-select S --translated-key-scale A`` fits on the path the gate serves instead of the
plain one: each item's translated keys are multiplied by A and the crux the path recomputes (R of the
context, chosen by S) replaces their translations, recomputed once with the starting correction. A
correction fitted on the plain path draws the question into the translated keys and away from that
crux (into Qwen2.5 it found more plain lookups and copied fewer codes on the served path,
eval/results/gate-kc-lookups/). A fit on the served path in turn lost plain-path lookups, so `--export`
ships it as that path's own correction (``repair_key_a``/``repair_key_b``, `mappers/bottleneck.py`)
beside the plain one, and a later ``--repair`` fit continues it.

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
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cag.context import CachedContext  # noqa: E402
from mappers.bottleneck import corrected_keys, direct_features, split_residual  # noqa: E402  (the runtime's own)

SEED_BASE = 700  # calib-needle seeds of this fit only (diagnosis 300, context mass 500)
LOOKUP_SEED_BASE = 700  # calib-lookup seeds of this fit only (gate 0, APE and γ 1, repair 2, source heads 3, lab ≥ 100 as text)
LOOKUPS_PER_SEED = 48   # of a pool's 60 questions: more pools, more distinct distractor sets


def training_needles(length: int, n: int, tokenizer, material: str = "facts") -> list:
    """`n` calibration needles in windows of about `length` target tokens of the lab's training essays."""
    from eval.diagnose_length import needles
    from eval.lab.data import training_essays

    return needles(length, n, tokenizer, seed_base=SEED_BASE, essays=training_essays(), material=material)


def training_lookups(n: int) -> list:
    """`n` multi-document calibration lookups (pools of `calib-lookup` seeds 700, 701, ...): the question
    retrieves its top chunks from its own pool, where facts of the same shape sit in other documents,
    the confusion `synthetic-kb` shows and the needles never do."""
    from eval.calibration_lookup import calibration_lookup

    items, seed = [], LOOKUP_SEED_BASE
    while len(items) < n:
        items += calibration_lookup(seed=seed)[:min(LOOKUPS_PER_SEED, n - len(items))]
        seed += 1
    return items


def essay_questions(n: int, more: bool = False) -> list:
    """The first `n` free questions about the calibration essays (-1: all of them), each retrieving its
    top chunks from all calibration essays: answers in running prose, which lookups and needles never
    ask for (essay-qa is where the served path lost answers, eval/results/repair_sentence_crux_fused_15_kc/).
    `more`: from the second file of them (84 questions on the lab's training essays, other facts)."""
    from eval.datasets import calibration_essay_qa, calibration_essay_qa_more

    if n == 0:
        return []
    items = calibration_essay_qa_more() if more else calibration_essay_qa()
    return items if n < 0 else items[:n]


def end_of_turn_id(lm, asm) -> int | None:
    """The token a chat answer ends with (Qwen's ``<|im_end|>``, Gemma's ``<end_of_turn>``, else EOS);
    None for a plain layout, whose answers end with no one token."""
    if not asm.layout.chat:
        return None
    from cag.generate import CHAT_TURN_ENDS

    vocab = lm.tokenizer.get_vocab()
    for marker in CHAT_TURN_ENDS:
        if marker in vocab:
            return int(vocab[marker])
    return lm.tokenizer.eos_token_id


def artifact_correction(mapper, repair: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The artifact's own key correction (A, B), or None if it has none; with ``repair``, the one it
    serves on the ``+repair`` path (its own, else the plain one: what that path served before)."""
    if repair and getattr(mapper, "repair_key_correction_rank", 0):
        return mapper.weights["repair_key_a"], mapper.weights["repair_key_b"]
    if not getattr(mapper, "key_correction_rank", 0):
        return None
    return mapper.weights["key_a"], mapper.weights["key_b"]


@contextmanager
def key_correction_off(mapper):
    """Translate with the map alone: the fit starts from the artifact's correction, not on top of it."""
    had = "key_correction_rank" in mapper.settings
    rank = mapper.settings.get("key_correction_rank", 0)
    mapper.settings["key_correction_rank"] = 0
    try:
        yield
    finally:  # restored exactly: an added key would change the artifact's id, which `export` checks
        if had:
            mapper.settings["key_correction_rank"] = rank
        else:
            del mapper.settings["key_correction_rank"]


def placed_chunks(ctx: CachedContext, item) -> tuple[list, list, list[float] | None]:
    """The item's translated chunks as a query places them, their hits, and their keys' rank factors (the path's
    served rank key decay, which multiplies the keys after the correction): a ``retrieve`` item's top
    chunks from its own documents, best first; any other item's documents whole, in order (they tie,
    and ties are not decayed)."""
    from eval.diagnose_length import translated_chunks

    hits = None
    if item.context == "retrieve":
        hits = ctx._order(ctx.retrieve(item.question, doc_ids=[d.id for d in item.documents]))
    chunks, used = translated_chunks(ctx, item, hits)
    return chunks, used, ctx.rank_key_scales(used)


def served_crux(ctx: CachedContext, chunks: list, used: list, question: str, repair: dict,
                start: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The crux the served ``+repair`` path recomputes for this question: its context positions, chosen
    outside the target as the runtime chooses them (`CachedContext._guided_positions`), and their K/V
    as `recomputed_crux` computes them with the starting correction."""
    _, _, asm = ctx._ready()
    positions = ctx._guided_positions(question, chunks, used, asm, ratio=repair["ratio"], select=repair["select"])
    return recomputed_crux(asm, chunks, positions, key_scale=repair.get("translated_key_scale", 1.0), start=start)


@torch.no_grad()
def recomputed_crux(asm, chunks: list, positions: torch.Tensor, *, key_scale: float = 1.0,
                    start: tuple[torch.Tensor, torch.Tensor] | None = None):
    """(positions, keys, values): the target's K/V (rotated) of the context `positions`, recomputed as
    `Assembler.place` recomputes them, attending to the prompt head and to the translated ``chunks``
    (their keys position-free, before any key correction) corrected by ``start`` and multiplied by
    ``key_scale``. The fit holds them fixed while it learns the keys around them: a crux recomputed
    at every step would cost a partial prefill per step."""
    lm = asm.target
    prefix = asm.prefix()
    keys = torch.cat([c.keys for c in chunks], 2).float()
    if start is not None:
        keys = corrected_keys(keys, start[0].float(), start[1].float())
    keys = torch.cat([prefix.keys.float(), keys * key_scale], 2).to(lm.dtype)
    values = torch.cat([prefix.values, *[c.values for c in chunks]], 2).to(lm.dtype)
    rotated = lm.adapter.rotate(keys, torch.arange(keys.shape[2]))
    context_ids = torch.cat([prefix.token_ids, *[c.token_ids for c in chunks]])
    positions = torch.unique(positions.to(torch.long))  # sorted, as the recompute reads them
    with asm.model_lock:
        asm._recompute(rotated, values, context_ids, positions)  # writes the crux into these buffers
    return positions, rotated[:, :, positions].clone(), values[:, :, positions].clone()


@torch.no_grad()  # not inference_mode: the fit backpropagates through these keys
def translated_context(ctx: CachedContext, item, *, token_window: int = 0, repair: dict | None = None) -> dict:
    """Position-free K/V ``[L, H, T, D]`` of prompt head + the item's translated chunks as placed
    (`placed_chunks`), the keys before the artifact's key correction, and each context token's rank
    factor (``scale``, applied after it); with ``token_window`` > 0 also the target's direct-path
    features of the translated tokens (`mappers.bottleneck.direct_features`, centred as the artifact's
    token residual centres them), which the token part of the correction reads. With ``repair``
    (``{"ratio", "select", "translated_key_scale"}``: a gate ``+repair`` setting) the item is placed as
    that path serves it: the translated keys multiplied by the key scale, and the crux the path
    recomputes (`served_crux`) in place of their translations."""
    _, mapper, asm = ctx._ready()
    with key_correction_off(mapper):
        chunks, used, factors = placed_chunks(ctx, item)
    prefix = asm.prefix()
    factors = factors or [1.0] * len(chunks)
    placed = {"keys": torch.cat([prefix.keys, *[c.keys for c in chunks]], 2).float(),
              "values": torch.cat([prefix.values, *[c.values for c in chunks]], 2).float(),
              "scale": torch.cat([torch.full((c.keys.shape[2],), float(f)) for c, f in zip(chunks, factors)]),
              "n_prefix": prefix.num_tokens, "question": item.question, "answer": item.answers[0]}
    if repair is not None:
        placed["key_scale"] = float(repair.get("translated_key_scale", 1.0))
        placed["crux"] = served_crux(ctx, chunks, used, item.question, repair, artifact_correction(mapper, True))
    if token_window:
        mean_f = mapper.weights["tok_mean_f"]
        # bf16 on purpose: 24 KB a token for Qwen2.5 instead of 49, and only the correction reads it
        placed["features"] = torch.cat([direct_features(ctx.target_model, c.token_ids, token_window)
                                        - mean_f[:, None, :] for c in chunks], 1).to(torch.bfloat16)
    return placed


def feature_scale(features: list[torch.Tensor]) -> torch.Tensor:
    """``[L, F]``: the root mean square of each (already centred) token feature over the given items."""
    total = sum((f.float() ** 2).sum(1) for f in features)
    count = sum(f.shape[1] for f in features)
    return (total / count).sqrt().clamp_min(1e-6)


def token_delta(features: torch.Tensor, w: dict, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The token part ``(f − f̄) U V + c`` per layer, split into keys and values ``[L, H, T, D]``:
    the same form as the artifact's token residual, so `export` folds it into ``tok_w``/``tok_mean_r``."""
    return split_residual(torch.bmm(torch.bmm(features.float(), w["u"]), w["v"]) + w["c"][:, None, :], num_kv_heads)


def answer_nll(lm, asm, placed: dict, w: dict) -> torch.Tensor:
    n = placed["n_prefix"]
    keys, values = placed["keys"][:, :, n:], placed["values"][:, :, n:]
    if "u" in w:
        dk, dv = token_delta(placed["features"], w, keys.shape[1])
        keys, values = keys + dk, values + dv
    keys = corrected_keys(keys, w["a"], w["b"]) * placed.get("key_scale", 1.0)  # a +repair path's α
    keys = torch.cat([placed["keys"][:, :, :n], keys], 2)  # the head stays native
    values = torch.cat([placed["values"][:, :, :n], values], 2).to(lm.dtype)
    rotated = lm.adapter.rotate(keys.to(lm.dtype), torch.arange(keys.shape[2]))
    if "crux" in placed:  # the recomputed tokens replace their translations (fixed: no gradient)
        at, crux_keys, crux_values = placed["crux"]
        rotated = rotated.index_copy(2, at, crux_keys.to(lm.dtype))
        values = values.index_copy(2, at, crux_values.to(lm.dtype))
    # The rank decay multiplies whole chunks after the correction and the recompute, as `Assembler.place`
    # does; rotation is linear per position, so scaling the rotated keys is the same.
    rotated = rotated * torch.cat([torch.ones(n), placed["scale"]]).to(lm.dtype)[:, None]
    cache = lm.adapter.fill_cache(rotated, values)
    q = asm.question_ids(placed["question"])
    gold = lm.tokenize(placed["answer"] if asm.layout.chat else " " + placed["answer"])[0]
    if placed.get("end_id") is not None:  # the answer ends the turn: teaches the map's keys to let it stop
        gold = torch.cat([gold, torch.tensor([placed["end_id"]])])
    hidden = lm.model.model(input_ids=torch.cat([q, gold[:-1]])[None], past_key_values=cache,
                            use_cache=True).last_hidden_state
    return torch.nn.functional.cross_entropy(lm.model.lm_head(hidden[0, -gold.numel():]).float(), gold)


def initial_weights(lm, *, rank: int, token_rank: int = 0, feature_width: int = 0,
                    start: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """A and B (from ``start``, the artifact's own correction, or B = 0: the map itself), and with
    ``token_rank`` the token part U, V, c with V = c = 0. Every start is exactly what is shipped."""
    fp = lm.fingerprint
    g = torch.Generator().manual_seed(0)
    d = fp.head_dim
    if start is not None:
        w = {"a": start[0].float().clone(), "b": start[1].float().clone()}
    else:
        w = {"a": torch.randn(fp.num_layers, fp.num_kv_heads, d, rank, generator=g) / d ** 0.5,
             "b": torch.zeros(fp.num_layers, fp.num_kv_heads, rank, d)}
    if token_rank:
        hd2 = 2 * fp.num_kv_heads * d
        w.update(u=torch.randn(fp.num_layers, feature_width, token_rank, generator=g) / feature_width ** 0.5,
                 v=torch.zeros(fp.num_layers, token_rank, hd2), c=torch.zeros(fp.num_layers, hd2))
    return {k: t.requires_grad_(True) for k, t in w.items()}


def fit(lm, asm, train: list[dict], held: list[dict], weights: dict[str, torch.Tensor], *, epochs: int, lr: float,
        l2: float, token_lr: float | None = None, progress=None) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """Adam on the gold answers' NLL through the frozen target; the epoch with the lowest held-out NLL
    (epoch 0: the starting weights) is returned. ``token_lr``: the token part's own step size."""
    groups = [{"params": [weights["a"], weights["b"]], "lr": lr}]
    if "u" in weights:
        groups.append({"params": [weights["u"], weights["v"], weights["c"]], "lr": token_lr or lr})
    opt = torch.optim.Adam(groups)
    frozen = [(p, p.requires_grad) for p in lm.model.parameters()]
    for p, _ in frozen:
        p.requires_grad_(False)
    try:
        return _fit_loop(lm, asm, train, held, weights, opt, epochs=epochs, l2=l2, progress=progress)
    finally:
        for p, flag in frozen:  # the caller's model is left as it was
            p.requires_grad_(flag)


def _penalty(w: dict, start: dict) -> torch.Tensor:
    """||A B − A₀ B₀||² + ||U V||²: the size of what the fit adds to the starting weights."""
    out = ((w["a"] @ w["b"] - start["a"] @ start["b"]) ** 2).sum()
    if "u" in w:
        out = out + ((w["u"] @ w["v"]) ** 2).sum()
    return out


def _fit_loop(lm, asm, train, held, w, opt, *, epochs: int, l2: float, progress):
    def held_nll() -> float:
        with torch.no_grad():
            return sum(float(answer_nll(lm, asm, p, w)) for p in held) / max(1, len(held))

    def snapshot() -> dict:
        return {k: t.detach().clone() for k, t in w.items()}

    g = torch.Generator().manual_seed(0)
    start = snapshot()
    history = [{"epoch": 0, "held_nll": held_nll()}]            # the starting weights
    best = (history[0]["held_nll"], 0, start)
    for epoch in range(1, epochs + 1):
        total = 0.0
        for i in torch.randperm(len(train), generator=g).tolist():
            loss = answer_nll(lm, asm, train[i], w)
            opt.zero_grad()
            (loss + l2 * _penalty(w, start)).backward()
            opt.step()
            total += float(loss.detach())
            if progress is not None:
                progress.advance(1)
        # train NLL is the running mean while fitting; held NLL is after the epoch
        history.append({"epoch": epoch, "train_nll": total / len(train), "held_nll": held_nll()})
        if history[-1]["held_nll"] < best[0]:
            best = (history[-1]["held_nll"], epoch, snapshot())
    return best[2], history + [{"chosen_epoch": best[1]}]


def fold_into(mapper, weights: dict[str, torch.Tensor], repair: bool = False) -> None:
    """Install a fitted correction in a bottleneck mapper: A and B as its key correction (``repair``: as
    the correction of its ``+repair`` path, the plain one kept), and the token part, which has the token
    residual's form, folded into ``tok_w`` and ``tok_mean_r`` (no new tensors)."""
    prefix = "repair_" if repair else ""
    if repair and "u" in weights:
        raise ValueError("a token part changes the translation itself, which both paths share: fit it on "
                         "the plain path")
    tensors = {**mapper.weights, f"{prefix}key_a": weights["a"], f"{prefix}key_b": weights["b"]}
    if "u" in weights:
        tensors["tok_w"] = mapper.weights["tok_w"] + weights["u"] @ weights["v"]
        tensors["tok_mean_r"] = mapper.weights["tok_mean_r"] + weights["c"]
    mapper.settings[f"{prefix}key_correction_rank"] = int(weights["a"].shape[-1])
    mapper.set_weights(**tensors)


def export(source: str, target: str, method: str, out: Path, tag: str = "") -> int:
    """Add the fitted correction to the shipped artifact it was fitted on (same folder: it replaces it):
    a fit on the ``+repair`` path becomes that path's correction, and the plain path keeps its own."""
    from safetensors.torch import load_file

    from mappers.base import load_mapper

    stem = f"{source}__{target}__{method}"
    meta = json.loads((out / f"{stem}{tag}.json").read_text())
    weights = load_file(str(out / f"{stem}{tag}.safetensors"))
    folder = ROOT / "mappers" / "pretrained" / stem
    mapper = load_mapper(folder)
    if mapper.artifact_id != meta["mapper_artifact"]:
        raise SystemExit(f"{folder} is artifact {mapper.artifact_id}; the correction was fitted on "
                         f"{meta['mapper_artifact']}: fit it again")
    repair = bool(meta.get("repair"))
    fold_into(mapper, weights, repair=repair)
    recorded = ("command", "date", "host", "mapper_artifact", "rank", "token_rank", "lengths", "n_per_length",
                "material", "seed_base", "lookups", "lookup_seed_base", "teach_stop", "essay_questions",
                "more_essay_questions", "repair", "history")
    mapper.fitted_on["repair_key_correction" if repair else "key_correction"] = {k: meta[k] for k in recorded
                                                                                 if k in meta}
    # Lookup records of the path it changes were measured without it; they are measured again, not carried over.
    dropped = ("lookup_repair",) if repair else ("lab_lookup", "lookup", "lookup_repair")
    mapper.fidelity = {k: v for k, v in mapper.fidelity.items() if k not in dropped}
    mapper.save(folder)
    print(f"{folder}: artifact {mapper.artifact_id} (was {meta['mapper_artifact']})")
    return 0


def record_lab(source: str, target: str, method: str, result_path: Path) -> int:
    """The lab's single-chunk lookup score of the shipped artifact, measured after the correction."""
    from mappers.base import Mapper, load_mapper, write_card

    folder = ROOT / "mappers" / "pretrained" / f"{source}__{target}__{method}"
    from eval.translation_lab import read_result

    result = read_result(result_path.with_name(result_path.name.removesuffix(".gz")))
    if result is None:
        raise SystemExit(f"{result_path}: no such lab result")
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
    ap.add_argument("--rank", type=int, default=8, help="rank of the key correction (the artifact's own, if it has one)")
    ap.add_argument("--token-rank", type=int, default=0, help="rank of a token part fitted with it: a change of the "
                    "artifact's token residual (the target's direct path of tokens t, t-1, ...), which carries which "
                    "token sits where, read when an answer is copied; 0: keys only")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--token-lr", type=float, default=3e-4, help="step size of the token part (its features are "
                    "standardised; at the keys' 2e-3 its first epoch undid the map: eval/results/key_correction)")
    ap.add_argument("--l2", type=float, default=1e-3, help="penalty on the correction's size, ||A B||²")
    ap.add_argument("--out", type=Path, default=ROOT / "eval" / "results" / "key_correction")
    ap.add_argument("--tag", default="", help="suffix of the result files' names (OUT/<pair>__<method><tag>.*)")
    ap.add_argument("--export", action="store_true", help="write the fitted correction (OUT) into the shipped "
                    "artifact in mappers/pretrained instead of fitting; its lookup records are dropped, to be "
                    "measured again (eval/gate_fidelity.py, translation_lab.py run --variants shipped)")
    ap.add_argument("--record-lab", type=Path, metavar="RESULT", help="write a `translation_lab.py run --variants "
                    "shipped` result (eval/results/lab/...json) into the shipped card as its lab_lookup record")
    ap.add_argument("--lookups", type=int, default=0, metavar="N", help="also N multi-document calibration lookups "
                    "(calib-lookup seeds 700, 701, ...: top chunks retrieved from the question's own pool, placed "
                    "best first with the path's served rank key decay), where same-shaped facts in other chunks "
                    "compete; --n 0 fits on them alone")
    ap.add_argument("--essay-questions", type=int, default=0, metavar="N", help="also the first N free questions "
                    "about the 17 calibration essays (eval/data/calib_essay_qa.jsonl, 4 per essay; -1: all 68), each "
                    "placed with its top chunks retrieved from all of them, as essay-qa's are from its pool")
    ap.add_argument("--more-essay-questions", type=int, default=0, metavar="N", help="also the first N of 84 "
                    "further free questions on the lab's 14 training essays (eval/data/calib_essay_qa_more.jsonl, "
                    "6 per essay, other facts; -1: all), placed the same way")
    ap.add_argument("--repair", type=float, default=0.0, metavar="RATIO", help="fit on the served +repair path: "
                    "each item placed with this share of its context recomputed by the target (the crux, chosen by "
                    "--repair-select with the starting correction, held fixed while fitting) and the translated keys "
                    "multiplied by --translated-key-scale; 0: the plain translated path")
    ap.add_argument("--repair-select", default="source_retriever")
    ap.add_argument("--translated-key-scale", type=float, default=1.0)
    ap.add_argument("--teach-stop", action="store_true", help="the teacher-forced answer ends with the chat turn's "
                    "end token: a correction fitted on the answer alone learned to find it and not to stop "
                    "(eval/results/key_correction/README.md, copy loops like 'Mudra Mudra Mudra')")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    if args.export:
        return export(args.source, args.target, args.method, args.out, args.tag)
    if args.record_lab:
        return record_lab(args.source, args.target, args.method, args.record_lab)

    lm = registry.load(args.target, "auto")
    items = [it for length in args.lengths for m in args.material
             for it in training_needles(length, args.n, lm.tokenizer, m)] if args.n else []
    items += training_lookups(args.lookups)
    items += essay_questions(args.essay_questions)
    items += essay_questions(args.more_essay_questions, more=True)
    if not items:
        raise SystemExit("nothing to fit on: --n 0, no --lookups, no --essay-questions or --more-essay-questions")
    ctx = measurement_context(items, args.out, args.source, args.target, args.method)
    _, mapper, asm = ctx._ready()
    repair = {"ratio": args.repair, "select": args.repair_select,
              "translated_key_scale": args.translated_key_scale} if args.repair > 0 else None
    # continue the correction the path serves now, never stack a second
    start = artifact_correction(mapper, repair is not None)
    if start is not None:
        args.rank = int(start[0].shape[-1])
    window = mapper.token_window if args.token_rank else 0
    if args.token_rank and not mapper.token_residual:
        raise SystemExit(f"{args.method} artifact has no token residual for --token-rank to change")
    if args.token_rank and repair is not None:
        raise SystemExit("--token-rank changes the translation both paths share: fit it without --repair")
    with Progress("translating", total=len(items), unit="items", interval_s=20) as bar:
        placed = []
        for it in items:
            placed.append(translated_context(ctx, it, token_window=window, repair=repair))
            bar.advance(1)
    if args.teach_stop:
        end = end_of_turn_id(lm, asm)
        for p in placed:
            p["end_id"] = end
    # Hold out every fourth item (all lengths represented) to choose the epoch.
    held = [p for i, p in enumerate(placed) if i % 4 == 3]
    train = [p for i, p in enumerate(placed) if i % 4 != 3]
    if window:  # standardise the token features (per layer and feature, training items); U absorbs it below
        sigma = feature_scale([p["features"] for p in train])
        for p in placed:
            p["features"] = (p["features"].float() / sigma[:, None]).to(torch.bfloat16)
    weights = initial_weights(lm, rank=args.rank, token_rank=args.token_rank, start=start,
                              feature_width=placed[0]["features"].shape[-1] if window else 0)
    with Progress("key correction", total=args.epochs * len(train), unit="steps", interval_s=20) as bar:
        weights, history = fit(lm, asm, train, held, weights, epochs=args.epochs, lr=args.lr, l2=args.l2,
                               token_lr=args.token_lr, progress=bar)
    if window:  # on the artifact's own (unstandardised) features, as `export` folds it
        weights["u"] = weights["u"] / sigma[:, :, None]
    stem = f"{args.source}__{args.target}__{args.method}{args.tag}"   # not with_suffix: "qwen2.5" has a dot
    save_file({k: t.contiguous() for k, t in weights.items()}, str(args.out / f"{stem}.safetensors"))
    meta = {"source": args.source, "target": args.target, "method": args.method,
            "mapper_artifact": getattr(mapper, "artifact_id", args.method), "rank": args.rank,
            "token_rank": args.token_rank, "started_from_artifact_correction": start is not None,
            "lengths": args.lengths, "n_per_length": args.n, "material": args.material,
            "lookups": args.lookups, "lookup_seed_base": LOOKUP_SEED_BASE, "teach_stop": args.teach_stop,
            "essay_questions": args.essay_questions, "more_essay_questions": args.more_essay_questions,
            "repair": repair,
            "train_items": len(train), "held_items": len(held),
            "seed_base": SEED_BASE, "lr": args.lr, "token_lr": args.token_lr, "l2": args.l2, "history": history,
            "tag": args.tag, "command": " ".join(["python", *sys.argv]), "date": time.strftime("%Y-%m-%d %H:%M"),
            "host": host_info().get("cpu", "")}
    (args.out / f"{stem}.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(json.dumps(history))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
