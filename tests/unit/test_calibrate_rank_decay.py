"""eval/calibrate_rank_decay.py: the choice rule and the defaults file it writes."""

import json

from eval.calibrate_rank_decay import bootstrap_choice, point_name, schedule_scales, write_defaults


def test_the_lowest_kl_is_chosen_only_when_its_gain_is_clear():
    clear = {(1.0, None): [0.5, 0.6, 0.4, 0.5], (0.9, None): [0.3, 0.4, 0.2, 0.3], (0.9, 2): [0.4, 0.5, 0.3, 0.4]}
    rows, chosen = bootstrap_choice(clear)
    assert (chosen["decay"], chosen["max_rank"]) == (0.9, None) and chosen["gain_low"] > 0
    assert {(r["decay"], r["max_rank"]) for r in rows} == set(clear)
    noisy = {(1.0, None): [0.5, 0.1, 0.9, 0.2], (0.9, None): [0.1, 0.6, 0.3, 0.5]}  # lower on average, not clearly
    assert bootstrap_choice(noisy)[1]["decay"] == 1.0


def test_the_schedule_caps_the_exponent_and_leaves_gamma_one_alone():
    assert schedule_scales(3, 1.0, None) is None
    assert schedule_scales(4, 0.5, None) == [1.0, 0.5, 0.25, 0.125]
    assert schedule_scales(5, 0.5, 2) == [1.0, 0.5, 0.25, 0.25, 0.25]
    assert point_name((0.9, None)) == "0.9" and point_name((0.9, 3)) == "0.9|3"  # the old progress keys hold


def test_the_decay_joins_the_entry_and_keeps_what_it_held(tmp_path):
    path = tmp_path / "ape_defaults.json"
    path.write_text(json.dumps({"fp": {"name": "m", "temperature": 1.1, "scale": 0.9, "n": 50}}))
    write_defaults([{"fingerprint": "fp", "target": "m", "chosen": {"decay": 0.85}},
                    {"fingerprint": "new", "target": "n", "chosen": {"decay": 1.0}}], "cmd", path)
    got = json.loads(path.read_text())
    assert got["fp"] == {"name": "m", "temperature": 1.1, "scale": 0.9, "n": 50, "rank_key_decay": 0.85,
                         "rank_key_decay_command": "cmd"}
    assert got["new"]["rank_key_decay"] == 1.0 and got["new"]["temperature"] == 1.0


def test_a_translated_paths_decay_goes_into_its_mappers_card_only(tmp_path, monkeypatch):
    import pytest

    import cag.mapping
    from eval.calibrate_rank_decay import write_card_decay
    from mappers.base import ARTIFACT_FORMAT, ARTIFACT_VERSION, Mapper

    cards = {}
    for name, (src, tgt, method) in {"a": ("s", "t", "bottleneck"), "b": ("s", "u", "bottleneck"),
                                     "c": ("s", "t", "mot")}.items():
        folder = tmp_path / name
        folder.mkdir()
        cards[name] = {"format": ARTIFACT_FORMAT, "version": ARTIFACT_VERSION, "method": method, "source": {"name": src}, "target": {"name": tgt}, "fidelity": {"lookup": 1}}
        (folder / "card.json").write_text(json.dumps(cards[name]))
    monkeypatch.setattr(cag.mapping, "available_mappers",
                        lambda: [(tmp_path / n, c) for n, c in cards.items()])
    result = {"source": "s", "target": "t", "n": 50, "top_k": 4, "mapper": {"method": "bottleneck", "artifact_id": "x"},
              "chosen": {"decay": 0.9, "kl": 0.2}}
    assert write_card_decay(result, "cmd") == tmp_path / "a"
    got = Mapper.read_card(tmp_path / "a")
    assert got["fidelity"]["lookup"] == 1 and got["fidelity"]["rank_key_decay"]["value"] == 0.9
    assert got["fidelity"]["rank_key_decay"]["artifact_id"] == "x"
    assert "rank_key_decay" not in Mapper.read_card(tmp_path / "b")["fidelity"]
    with pytest.raises(SystemExit, match="no shipped"):
        write_card_decay({**result, "target": "v"}, "cmd")


def test_a_capped_choice_is_never_written_where_the_runtime_would_serve_it_uncapped(tmp_path, monkeypatch):
    import pytest

    import eval.calibrate_rank_decay as crd

    row = {"decay": 0.9, "max_rank": 3, "kl": 0.2, "gain": 0.1, "gain_low": 0.05, "gain_high": 0.15,
           "kl_at": {"4": 0.2}}
    result = {"target": "m", "n": 1, "top_k": 4, "ape": [1.0, 1.0], "grid": [row], "chosen": row,
              "fingerprint": "fp", "source": None, "mapper": None}
    monkeypatch.setattr(crd, "calibration_lookup", lambda seed: [])
    monkeypatch.setattr(crd, "calibrate", lambda *a, **k: result)
    monkeypatch.setattr(crd, "write_defaults", lambda *a, **k: pytest.fail("a capped γ was written"))
    with pytest.raises(SystemExit, match="capped"):
        crd.main(["--targets", "m", "--caps", "3", "--out", str(tmp_path)])
    assert (tmp_path / "calibration.md").exists()                  # the tables are kept
    assert crd.main(["--targets", "m", "--caps", "3", "--out", str(tmp_path), "--no-write"]) == 0
