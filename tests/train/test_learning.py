"""Whether a run learns: τ within noise of 1.0 named as a problem, with the causes the settings show."""

from flashdraft.evaluation.results import accepts_nothing, accepts_nothing_problem
from flashdraft.train.learning import LearningCheck, learning_problem, likely_causes, mean_record_length


def test_a_tau_within_noise_of_one_accepts_nothing_and_a_learned_one_does_not():
    assert accepts_nothing(1.0) and accepts_nothing(1.04)
    assert not accepts_nothing(1.06) and not accepts_nothing(3.0)
    assert "accepts (almost) nothing" in accepts_nothing_problem(1.0, "held-out τ")
    assert accepts_nothing_problem(1.3, "held-out τ") is None


def test_the_likely_causes_name_the_lr_the_steps_and_anchors_for_the_data_with_their_fix():
    causes, fixes = likely_causes(lr=1e-12, total_steps=43, num_anchors=512, mean_length=300)
    assert [c.split()[0] for c in causes] == ["--lr", "only", "--num-anchors"]
    assert fixes == "--lr 6e-4 --max-steps 1000 --num-anchors 9"
    assert likely_causes(lr=6e-4, total_steps=20000, num_anchors=512, mean_length=3000) == ([], "")


def test_a_learning_problem_is_one_warning_line_with_causes_and_a_command():
    line = learning_problem(1.0, "held-out τ", 43, lr=1e-12, total_steps=43, num_anchors=512, mean_length=300)
    assert line.startswith("warning: step 43: held-out τ 1.000") and "\n" not in line
    assert "likely: --lr 1e-12 is small" in line and "try: flashdraft train ... --lr 6e-4" in line
    assert learning_problem(1.4, "held-out τ", 43, lr=1e-12, total_steps=43, num_anchors=8, mean_length=300) is None


def test_the_check_warns_once_past_the_warm_up_and_a_quarter_and_says_the_verdict():
    check = LearningCheck(lr=6e-3, total_steps=400, warmup_steps=16, num_anchors=8, mean_length=300, held_out=True)
    assert check.see(50, 1.0, held_out=True) is None  # before a quarter of the run: still learning, maybe
    assert check.see(100, 1.2, held_out=False) is None  # the estimate is not watched where held-out τ is
    assert check.see(100, 1.0, held_out=True).startswith("warning: step 100")
    assert check.see(200, 1.0, held_out=True) is None  # once
    assert check.verdict().startswith("problem: step 200: held-out τ 1.000")
    check.see(400, 1.5, held_out=True)
    assert check.verdict() == "held-out τ 1.500 at step 400 (an untrained drafter: 1.0)"


def test_records_length_comes_from_a_cache_manifest_or_online_ids():
    class Cache:
        lengths = [100, 300]

    class Record:
        def __init__(self, n):
            self.input_ids = list(range(n))

    class Online:
        records = [Record(10), Record(30)]

    assert mean_record_length(Cache()) == 200 and mean_record_length(Online()) == 20
    assert mean_record_length([]) is None
