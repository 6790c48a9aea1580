"""The thread tuner: which of two thread counts runs the engine's passes, learned from the
passes' own timings (fed here as numbers: the tuner's decisions, not the machine's speed)."""

from __future__ import annotations

import torch

from app.engine import thread_tuner
from app.engine.thread_tuner import ThreadTuner


def drive(tuner: ThreadTuner, seconds_on: dict[int, float], passes: int, rows: int = 1) -> list[int]:
    """Run `passes` passes where a pass on n threads takes seconds_on[n]; the counts used."""
    used = []
    for _ in range(passes):
        tuner.before_pass()
        n = tuner.threads_for_pass()
        used.append(n)
        tuner.after_pass(rows, seconds_on[n])
    return used


def recorder():
    calls: list[int] = []
    return calls, calls.append


def test_candidates_are_all_threads_and_half():
    assert ThreadTuner(8, lambda n: None).candidates == [8, 4]
    assert ThreadTuner(2, lambda n: None).candidates == [2, 1]
    assert ThreadTuner(3, lambda n: None).candidates == [3, 1]


def test_one_thread_means_no_tuning_and_no_calls():
    calls, setter = recorder()
    tuner = ThreadTuner(1, setter)
    drive(tuner, {1: 0.01}, 500)
    assert not tuner.enabled and calls == [] and tuner.probes == 0


def test_switches_to_fewer_threads_when_they_are_faster():
    # A busy machine: the second core is taken, two threads wait on each other.
    calls, setter = recorder()
    tuner = ThreadTuner(2, setter)
    used = drive(tuner, {2: 0.100, 1: 0.020}, 200)
    assert calls[0] == 2 and tuner.current == 1 and tuner.switches == 1
    assert used[:thread_tuner.FIRST_PROBE] == [2] * thread_tuner.FIRST_PROBE
    # Found within the first probe; everything after it runs on one thread but the probes.
    first_one = used.index(1)
    assert first_one == thread_tuner.FIRST_PROBE
    assert used[first_one:].count(2) <= 2 * thread_tuner.PROBE_PASSES


def test_keeps_all_threads_when_they_are_faster_and_then_probes_rarely():
    calls, setter = recorder()
    tuner = ThreadTuner(2, setter)
    used = drive(tuner, {2: 0.010, 1: 0.016}, 5000)
    assert tuner.current == 2 and tuner.switches == 0
    # After the first probe fails, passes that do not slow down are probed every MAX_EVERY
    # passes only; each probe ends at its first counted pass: the waking pass and that one.
    assert 2 <= tuner.probes <= 4
    assert used.count(1) == 2 * tuner.probes


def test_an_idle_machines_reply_is_probed_once():
    tuner = ThreadTuner(2, lambda n: None)
    used = drive(tuner, {2: 0.010, 1: 0.015}, 128)
    assert tuner.probes == 1 and used.count(1) == 2


def test_a_slowdown_on_all_threads_is_probed_at_once():
    """Another program starts mid-reply: all threads' passes get 5x slower; the tuner
    probes within a window of such passes, long before its schedule would."""
    tuner = ThreadTuner(2, lambda n: None)
    drive(tuner, {2: 0.010, 1: 0.015}, 200)
    assert tuner.probes == 1 and tuner.current == 2
    used = drive(tuner, {2: 0.050, 1: 0.020}, 20)
    assert tuner.current == 1 and tuner.switches == 1
    assert used.index(1) <= 5  # a window of slow passes, then the probe


def test_a_small_slowdown_calls_no_probe():
    """Passes a little slower (a longer context, noise) are not contention."""
    tuner = ThreadTuner(2, lambda n: None)
    drive(tuner, {2: 0.010, 1: 0.015}, 200)
    drive(tuner, {2: 0.013, 1: 0.020}, 500)
    assert tuner.probes == 1


def test_a_probe_far_slower_is_cut_short():
    tuner = ThreadTuner(2, lambda n: None)
    used = drive(tuner, {2: 0.010, 1: 0.030}, 5000)
    assert tuner.current == 2
    assert used.count(1) == 2 * tuner.probes  # the waking pass and one counted pass


def test_a_probe_a_little_slower_ends_at_its_first_counted_pass():
    tuner = ThreadTuner(2, lambda n: None)
    used = drive(tuner, {2: 0.0100, 1: 0.0104}, 4000)
    assert tuner.current == 2 and tuner.probes >= 2
    assert used.count(1) == 2 * tuner.probes


def test_a_small_gain_within_the_margin_does_not_switch():
    tuner = ThreadTuner(2, lambda n: None)
    drive(tuner, {2: 0.0100, 1: 0.0097}, 1000)
    assert tuner.current == 2 and tuner.switches == 0


def test_follows_the_machine_when_the_load_goes_away():
    tuner = ThreadTuner(2, lambda n: None)
    drive(tuner, {2: 0.100, 1: 0.020}, 100)
    assert tuner.current == 1
    # The other program ended: all threads are faster again. Probes are spaced out after
    # failing while the machine was busy, but the change is found.
    drive(tuner, {2: 0.008, 1: 0.014}, 4000)
    assert tuner.current == 2


def test_only_passes_of_the_same_size_are_compared():
    tuner = ThreadTuner(2, lambda n: None)
    drive(tuner, {2: 0.010, 1: 0.016}, thread_tuner.FIRST_PROBE)  # a probe is due now
    assert tuner.probing
    # The next pass carries a prefill chunk (many rows, much slower): the probe is dropped,
    # not judged against one-row passes, and nothing switches.
    tuner.before_pass()
    tuner.after_pass(rows=300, seconds=0.5)
    assert not tuner.probing and tuner.current == 2 and tuner.switches == 0


# ---- in the engine: a real model, the counts switching mid-reply ----------------------------

def test_switching_threads_mid_reply_changes_no_token(smollm2_model_path, monkeypatch):
    from app.engine.device import load_on
    from app.engine.engine import Engine, EngineConfig
    from app.engine.sampling import SamplingParams

    from tests.engine.test_engine import run, tokens_of

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(thread_tuner, "FIRST_PROBE", 1)
    monkeypatch.setattr(thread_tuner, "EVERY", 2)
    monkeypatch.setattr(thread_tuner, "MARGIN", -10.0)  # every probe that runs to its end switches
    monkeypatch.setattr(thread_tuner, "GIVE_UP", 1e9)
    torch.set_num_threads(2)
    loaded = load_on(smollm2_model_path, "cpu", "int4", measure=False)
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = {f"r{i}": ([1] + [200 + 37 * i + j for j in range(20 + 9 * i)], greedy) for i in range(2)}
    try:
        results = {}
        for tune in (False, True):
            engine = Engine(loaded, EngineConfig(kv_tokens=2048, tune_threads=tune))
            results[tune] = {rid: tokens_of(ev) for rid, ev in run(engine, prompts).items()}
        assert engine.threads.switches >= 2  # the counts really changed while replies ran
        assert results[True] == results[False]
    finally:
        torch.set_num_threads(2)


def test_an_engine_tunes_from_all_threads_whatever_count_was_left_set(smollm2_model_path,
                                                                       monkeypatch):
    """An engine before it (a model swap, bench's next run on the same thread) may have left
    torch on the fewer-threads count; a new engine still starts from all of them."""
    from app.engine.device import cpu_threads, load_on
    from app.engine.engine import Engine, EngineConfig

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    loaded = load_on(smollm2_model_path, "cpu", "int4", measure=False)
    try:
        torch.set_num_threads(1)
        engine = Engine(loaded, EngineConfig(kv_tokens=256))
        assert engine.threads.most == cpu_threads()
        engine.threads.before_pass()
        assert torch.get_num_threads() == cpu_threads()
    finally:
        torch.set_num_threads(cpu_threads())
