"""The commands that refit a shipped bottleneck map, read from its card.

A lab map is not one fit but a chain of tools, each resumable on its own: the lab's aligned rows
(`translation_lab.py build`), the variant scored and exported (`run`, `export`), the key corrections fitted
through the frozen target and written into the artifact (`fit_key_correction.py`, then the same with
`--export`; the crux path's correction after the plain one, since it is fitted with the plain one in place), the
lab's lookup score recorded (`run --variants shipped-bottleneck`, `fit_key_correction.py --record-lab`), and the
gate's lookup records measured again (`gate_fidelity.py --cards-only`, whose records `mapper="auto"` ranks by; an
export drops them). `recipe(card)` lists those commands from what the card records: the variant from its settings,
every correction's and every measurement's command as it was run. `eval/fit_pretrained.py --methods bottleneck`
prints them, and runs them with `--run`.

Checked (twenty-third session): `export --variant rrr512+match+cal` from the Qwen2.5 -> SmolLM2 lab, whose rows and
fits were still on disk, rewrote the shipped map's four linear tensors bit for bit (`proj`, `coef`, `bias`,
`y_mean`; the key correction's `key_a`, `key_b` are the next steps'). The whole chain has not been run in one go.

What it does not refit: the decoding's calibrations that name the map they were measured with
(`cag/pointer_heads.json`, the copy prior's weight); they are chosen again by their own scripts if a refit wins.
"""

from __future__ import annotations

import shlex
from pathlib import Path

# Rows each shipped map's lab was built to (eval/TRANSLATION.md, each pair's section): the maps into Gemma-3
# were fitted on 61k-row labs (rank-bound there, not data-bound), Qwen2.5 -> SmolLM2's build stopped at 22 shards.
LAB_TOKENS = {
    ("smollm2-135m", "qwen2.5-0.5b"): 300_000,
    ("smollm2-135m", "gemma3-270m"): 61_000,
    ("gemma3-270m", "qwen2.5-0.5b"): 300_000,
    ("qwen2.5-0.5b", "gemma3-270m"): 61_000,
    ("gemma3-270m", "smollm2-135m"): 300_000,
    ("qwen2.5-0.5b", "smollm2-135m"): 155_000,
}
LAB_N = 40  # the lab's held-out needles every shipped map was scored on

# Plain-path key corrections continued over several fits, each from the artifact the one before exported, keyed by
# the artifact they made. Its card names the last command only: the chain is not part of the card, so adding it there
# would change the artifact's id, which its gate records were measured under (eval/results/gate-kc-essays-qwen-gemma).
KEY_CORRECTION_CHAINS = {
    "0a42f674953d96a2": [  # Qwen2.5 -> Gemma-3, twenty-third session
        "python eval/fit_key_correction.py --source qwen2.5-0.5b --target gemma3-270m --lengths 1024 2048 --n 24 "
        "--rank 8 --epochs 4",
        "python eval/fit_key_correction.py --source qwen2.5-0.5b --target gemma3-270m --lengths 1024 2048 --n 24 "
        "--material facts codes --lookups 96 --epochs 4 --teach-stop --tag .lookups96",
        "python eval/fit_key_correction.py --source qwen2.5-0.5b --target gemma3-270m --lengths 1024 2048 --n 24 "
        "--material facts codes --lookups 96 --essay-questions -1 --epochs 4 --teach-stop --tag .lookups96-essays",
    ],
}


def lab_variant(settings: dict, spread_matched: bool = True) -> str:
    """The lab's name for the linear map a bottleneck artifact holds (`eval/lab/variants.py`): reduced-rank
    regression at its rank, the keys' spread restored, the token residual over its window, the learned key scales.
    """
    if not settings.get("rank"):
        raise ValueError(f"a bottleneck card records its rank; got settings {settings}")
    name = f"rrr{settings['rank']}" + ("+match" if spread_matched else "")
    if settings.get("token_residual"):
        window = int(settings.get("token_window", 2))
        name += "+tok" if window == 2 else f"+tok{window}"
    return name + "+cal"


def _with(argv: list[str], flag: str, values: list[str]) -> list[str]:
    """`argv` with `flag`'s values replaced by `values` (appended where it had none)."""
    if flag not in argv:
        return [*argv, flag, *values]
    i = argv.index(flag) + 1
    j = i
    while j < len(argv) and not argv[j].startswith("--"):
        j += 1
    return [*argv[:i], *values, *argv[j:]]


def recipe(card: dict, python: str = "python", artifact_id: str | None = None) -> list[list[str]]:
    """Every command that refits the bottleneck map of `card`, in order, as argv lists (`python` first).
    `artifact_id`: the card's artifact, whose key correction may be a chain of fits (`KEY_CORRECTION_CHAINS`)."""
    if card.get("method") != "bottleneck":
        raise ValueError(f"not a bottleneck card: method {card.get('method')!r}")
    source, target = card["source"]["name"], card["target"]["name"]
    fitted, fidelity = card.get("fitted_on") or {}, card.get("fidelity") or {}
    pair = ["--source", source, "--target", target]
    lab = [python, "eval/translation_lab.py", *pair]
    # exports record their variant since the twenty-third session; the six shipped before are named by their settings
    variant = fitted.get("lab_variant") or lab_variant(card["settings"], fitted.get("spread_matched", True))
    tokens = LAB_TOKENS.get((source, target), 300_000)
    steps = [[*lab, "build", "--tokens", str(tokens)],
             [*lab, "run", "--variants", variant, "--n", str(LAB_N)],
             [*lab, "export", "--variant", variant]]
    for key in ("key_correction", "repair_key_correction"):  # the plain path's first: the crux's is fitted over it
        record = fitted.get(key)
        if not record:
            continue
        # A correction continued over several fits (each starts from the artifact the one before exported) is
        # replayed fit by fit; else its one command is the whole of it.
        chain = KEY_CORRECTION_CHAINS.get(artifact_id or "") if key == "key_correction" else None
        for command in chain or [record["command"]]:
            argv = shlex.split(command)
            argv[0] = python
            if "--source" not in argv:  # commands of the first labs left the default source (SmolLM2) implicit
                argv[2:2] = ["--source", source]
            steps += [argv, [*argv, "--export"]]
    result = f"eval/results/lab/{source}__{target}/shipped-bottleneck@refit.json"
    steps += [[*lab, "run", "--variants", "shipped-bottleneck", "--n", str(LAB_N), "--tag", "@refit"],
              [python, "eval/fit_key_correction.py", *pair, "--record-lab", result]]
    gate_out = f"eval/results/gate-refit/{source}__{target}"
    lookup = fidelity.get("lookup") or {}
    gates = [lookup.get("command")] + [r.get("command") for r in fidelity.get("lookup_repair") or []]
    for i, command in enumerate(c for c in gates if c):
        # A fresh folder (a gate run resumes from the rows in its folder, and the old map's answers must not be
        # read as the new one's), and the bottleneck alone (a method measured beside it then may be retired now).
        argv = _with(shlex.split(command), "--out", [gate_out if i == 0 else f"{gate_out}-repair{i}"])
        argv = _with(argv, "--methods", ["bottleneck"])
        argv[0] = python
        if "--cards-only" not in argv:  # the native records (native_lookup.json) are not the refit's to change
            argv.append("--cards-only")
        steps.append(argv)
    decay = fidelity.get("rank_key_decay") or {}
    if decay.get("command"):  # γ for this pair's map only (the recorded run calibrated both SmolLM2 pairs at once)
        argv = _with(shlex.split(decay["command"]), "--targets", [target])
        argv[0] = python
        steps.append(argv)
    return steps


def card_recipe(folder: Path, python: str = "python") -> list[list[str]]:
    import json

    from mappers.base import load_mapper

    return recipe(json.loads((folder / "card.json").read_text()), python, load_mapper(folder).artifact_id)
