"""The quality gate (#13): each path is chosen in turn as fidelities move around it; nothing
below the gate is served without the caller's explicit consent."""

import json

import pytest

from cag import gate
from cag.gate import GateError, PathFidelity, choose_path


def fid(path, found, direct=0.8, none=0.1, n=40):
    return PathFidelity(path, found_retention=found / direct, found_rate=found, direct_found_rate=direct,
                        no_context_found_rate=none, n=n, items="calib")


def test_each_path_is_picked_in_turn():
    native, translated = fid("native", 0.7), fid("translated", 0.5)
    assert choose_path([native], 0.6, "direct").path == "native"            # 0.875 ≥ 0.6
    assert choose_path([translated], 0.6, "direct").path == "translated"    # 0.625 ≥ 0.6
    assert choose_path([translated], 0.7, "direct").path == "direct"        # 0.625 < 0.7
    assert choose_path([fid("translated", 0.3), native], 0.6, "direct").path == "native"  # fastest that passes


def test_a_path_no_better_than_no_context_never_passes_by_default():
    useless = fid("translated", 0.1, none=0.1)  # found as often as with no context
    decision = choose_path([useless], gate.DEFAULT_MIN_RETENTION, "direct")
    assert decision.path == "direct" and "no more answers than no context" in decision.reason
    # Even with a retention the gate would accept, it must beat no context.
    assert choose_path([fid("translated", 0.1, direct=0.12, none=0.05)], 0.5, "direct").path == "translated"
    assert choose_path([fid("translated", 0.1, direct=0.12, none=0.12)], 0.5, "direct").path == "direct"


def test_unmeasured_is_not_good():
    decision = choose_path([PathFidelity("native")], 0.1, "direct")
    assert decision.path == "direct" and "no measured lookup fidelity" in decision.reason


def test_below_the_gate_only_with_consent_or_raise():
    useless = fid("translated", 0.0)
    with pytest.raises(GateError, match="min_retention=0"):
        choose_path([useless], 0.6, "raise")
    consented = choose_path([useless], 0.0, "raise")
    assert consented.path == "translated" and "gate off" in consented.reason
    with pytest.raises(ValueError):
        choose_path([useless], 0.6, "serve-anyway")


def test_records_are_read_from_cards_and_the_native_file(tmp_path, monkeypatch):
    card = {"method": "ridge", "fidelity": {"lookup": {"found_retention": 0.5, "found_rate": 0.4,
                                                       "no_context_found_rate": 0.1, "n": 30}}}
    t = gate.translated_fidelity(card, tmp_path / "a__b__ridge")
    assert t.measured and t.method == "ridge" and t.recorded_in == "a__b__ridge"
    assert not gate.translated_fidelity({"method": "ridge"}, "x").measured
    native_file = tmp_path / "native_lookup.json"
    native_file.write_text(json.dumps({"models": {"abc": {"found_retention": 0.9, "found_rate": 0.7,
                                                           "no_context_found_rate": 0.1, "n": 30}}}))
    monkeypatch.setattr(gate, "native_lookup_path", lambda: native_file)
    assert gate.native_fidelity("abc").verdict(0.6)[0]
    assert not gate.native_fidelity("other").measured


def test_repair_path_is_next_and_carries_its_setting():
    plain = fid("translated", 0.1, none=0.1)
    repaired = PathFidelity("translated+repair", found_retention=0.8, found_rate=0.64, direct_found_rate=0.8,
                            no_context_found_rate=0.1, n=40, repair={"ratio": 0.2, "select": "source"})
    decision = choose_path([plain, repaired], 0.6, "direct")
    assert decision.path == "translated+repair" and decision.fidelity.repair == {"ratio": 0.2, "select": "source"}
    assert [p for p, _ in decision.rejected] == ["translated"]
    record = {"found_retention": 0.8, "found_rate": 0.6, "no_context_found_rate": 0.1, "n": 9,
              "repair": {"ratio": 0.2, "select": "source"}}
    card = {"method": "heterofold", "fidelity": {"lookup_repair": record}}  # one record, as older cards hold
    [read] = gate.translated_repair_fidelities(card, "x")
    assert read.repair == {"ratio": 0.2, "select": "source"} and read.method == "heterofold"
    [unmeasured] = gate.translated_repair_fidelities({"method": "heterofold"}, "x")
    assert unmeasured.path == "translated+repair" and not unmeasured.measured


def record(found, ratio, select, scale=None, n=30):
    repair = {"ratio": ratio, "select": select, **({"translated_key_scale": scale} if scale else {})}
    return {"found_retention": found / 0.8, "found_rate": found, "direct_found_rate": 0.8,
            "no_context_found_rate": 0.0, "n": n, "repair": repair}


def test_several_repair_settings_the_cheapest_that_passes_is_served():
    slot = [record(0.64, 0.2, "retriever", 0.4), record(0.6, 0.15, "source_retriever", 0.5),
            record(0.4, 0.1, "retriever", 0.4), record(0.66, 0.15, "source", 0.5)]
    card = {"method": "bottleneck", "fidelity": {"lookup": record(0.1, 0, "none"), "lookup_repair": slot}}
    repairs = gate.translated_repair_fidelities(card, "x")
    # cheapest first: by the share recomputed, then by what the choice costs (retriever's vectors are free)
    assert [(f.repair["ratio"], f.repair["select"]) for f in repairs] == \
        [(0.1, "retriever"), (0.15, "source_retriever"), (0.15, "source"), (0.2, "retriever")]
    decision = choose_path([gate.translated_fidelity(card, "x"), *repairs], 0.6, "direct")
    assert decision.path == "translated+repair"
    assert gate.served_repair(decision) == {"ratio": 0.15, "select": "source_retriever", "translated_key_scale": 0.5}
    # the rejected 10% setting says which setting it was
    assert "retriever 10%, translated keys ×0.4" in decision.rejected[1][1]
    # a stricter gate moves on to the next setting that passes, not to direct context
    stricter = choose_path(repairs, 0.8, "direct")
    assert stricter.fidelity.repair == {"ratio": 0.15, "select": "source", "translated_key_scale": 0.5}


def test_a_repair_record_replaces_only_its_own_setting():
    first, other = record(0.5, 0.2, "retriever", 0.4), record(0.6, 0.15, "source_retriever", 0.5)
    slot = gate.with_repair_record(first, other)  # an older card's single record is kept beside the new one
    assert slot == [first, other]
    again = record(0.62, 0.2, "retriever", 0.4)
    assert gate.with_repair_record(slot, again) == [other, again]  # same setting: the new measurement wins
    unscaled = record(0.3, 0.2, "retriever")
    assert len(gate.with_repair_record(slot, unscaled)) == 3  # another key scale is another setting
    assert gate.repair_records("not a record") == [] and gate.repair_records([first, 3]) == [first]


def test_native_repair_records_from_the_native_file(tmp_path, monkeypatch):
    native_file = tmp_path / "native_lookup.json"
    native_file.write_text(json.dumps({"repair": {"abc": [record(0.7, 0.2, "retriever"), record(0.7, 0.1, "first_k")]}}))
    monkeypatch.setattr(gate, "native_lookup_path", lambda: native_file)
    assert [f.repair["select"] for f in gate.native_repair_fidelities("abc")] == ["first_k", "retriever"]
    [unmeasured] = gate.native_repair_fidelities("other")
    assert unmeasured.path == "native+repair" and not unmeasured.measured


def test_a_repair_record_speaks_only_for_its_own_settings_key_scale_included():
    crux = PathFidelity("translated+repair", repair={"ratio": 0.25, "select": "retriever_chunk",
                                                     "translated_key_scale": 0.3})
    assert crux.repair_matches(0.25, "retriever_chunk", 0.3)
    assert not crux.repair_matches(0.25, "retriever_chunk", 1.0)  # the unscaled path was not measured
    assert not crux.repair_matches(0.2, "retriever_chunk", 0.3)
    older = PathFidelity("translated+repair", repair={"ratio": 0.2, "select": "source"})  # no scale: 1
    assert older.repair_matches(0.2, "source") and not older.repair_matches(0.2, "source", 0.3)


def test_a_path_that_garbles_exact_answers_is_refused_though_its_lookups_pass():
    record = {"found_retention": 0.6, "found_rate": 0.5, "direct_found_rate": 0.83, "no_context_found_rate": 0.0,
              "n": 30, "items": "calib", "copy": {"found_retention": 0.25, "n": 24}}
    garbles = PathFidelity.from_record("translated", record, recorded_in="card")
    assert garbles.copy_found_retention == 0.25 and garbles.copy_n == 24
    decision = choose_path([garbles], 0.6, "direct")
    assert decision.path == "direct" and "copied exactly" in decision.rejected[0][1]
    copies = PathFidelity.from_record("translated", {**record, "copy": {"found_retention": 0.9, "n": 24}},
                                      recorded_in="card")
    decision = choose_path([copies], 0.6, "direct")
    assert decision.path == "translated" and "0.90 on answers copied exactly" in decision.reason
    # a record without the copy measurement is judged on its lookups, as before
    assert choose_path([PathFidelity.from_record("translated", {k: v for k, v in record.items() if k != "copy"},
                                                 recorded_in="card")], 0.6, "direct").path == "translated"


def test_a_path_that_loses_free_essay_questions_is_refused_and_the_next_one_served():
    base = {"found_rate": 0.83, "direct_found_rate": 0.83, "no_context_found_rate": 0.0, "n": 30, "items": "calib",
            "copy": {"found_retention": 0.95, "n": 24}}
    cheap = {**base, "found_retention": 1.0, "essays": {"found_retention": 0.5, "n": 36},
             "repair": {"ratio": 0.1, "select": "source_retriever"}}
    dear = {**base, "found_retention": 1.0, "essays": {"found_retention": 0.8, "n": 36},
            "repair": {"ratio": 0.13, "select": "source_retriever"}}
    cands = gate._repair_candidates("translated+repair", [dear, cheap], "card")
    assert [c.repair["ratio"] for c in cands] == [0.1, 0.13] and cands[0].essay_n == 36
    decision = choose_path(cands, 0.6, "direct")
    assert decision.path == "translated+repair" and decision.fidelity.repair["ratio"] == 0.13
    assert "0.50 on free questions about calibration essays (n=36)" in decision.rejected[0][1]
    assert "0.80 on free essay questions (n=36)" in decision.reason
    # without the essay measurement the cheaper record is judged as before, and served
    plain = {k: v for k, v in cheap.items() if k != "essays"}
    assert choose_path(gate._repair_candidates("translated+repair", [dear, plain], "card"), 0.6,
                       "direct").fidelity.repair["ratio"] == 0.1


def test_a_record_measured_with_a_copy_prior_is_served_with_it():
    record = {"found_retention": 0.9, "found_rate": 0.72, "direct_found_rate": 0.8, "no_context_found_rate": 0.1,
              "n": 30, "items": "calib", "copy_prior": 0.35}
    measured = PathFidelity.from_record("translated", record, recorded_in="card")
    assert measured.copy_prior == 0.35 and "copy prior 0.35" in measured.label
    decision = choose_path([measured], 0.6, "direct")
    assert decision.path == "translated" and gate.served_copy_prior(decision) == 0.35
    plain = PathFidelity.from_record("translated", {**record, "copy_prior": None}, recorded_in="card")
    assert plain.copy_prior == 0.0 and plain.label == "translated"
    assert gate.served_copy_prior(choose_path([fid("translated", 0.0)], 0.6, "direct")) == 0.0   # direct
