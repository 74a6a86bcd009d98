"""eval/calibrate_rank_decay.py: the choice rule and the defaults file it writes."""

import json

from eval.calibrate_rank_decay import bootstrap_choice, write_defaults


def test_the_lowest_kl_is_chosen_only_when_its_gain_is_clear():
    clear = {1.0: [0.5, 0.6, 0.4, 0.5], 0.9: [0.3, 0.4, 0.2, 0.3], 0.8: [0.4, 0.5, 0.3, 0.4]}
    rows, chosen = bootstrap_choice(clear)
    assert chosen["decay"] == 0.9 and chosen["gain_low"] > 0
    assert {r["decay"] for r in rows} == {1.0, 0.9, 0.8}
    noisy = {1.0: [0.5, 0.1, 0.9, 0.2], 0.9: [0.1, 0.6, 0.3, 0.5]}  # lower on average, not clearly
    assert bootstrap_choice(noisy)[1]["decay"] == 1.0


def test_the_decay_joins_the_entry_and_keeps_what_it_held(tmp_path):
    path = tmp_path / "ape_defaults.json"
    path.write_text(json.dumps({"fp": {"name": "m", "temperature": 1.1, "scale": 0.9, "n": 50}}))
    write_defaults([{"fingerprint": "fp", "target": "m", "chosen": {"decay": 0.85}},
                    {"fingerprint": "new", "target": "n", "chosen": {"decay": 1.0}}], "cmd", path)
    got = json.loads(path.read_text())
    assert got["fp"] == {"name": "m", "temperature": 1.1, "scale": 0.9, "n": 50, "rank_key_decay": 0.85,
                         "rank_key_decay_command": "cmd"}
    assert got["new"]["rank_key_decay"] == 1.0 and got["new"]["temperature"] == 1.0
