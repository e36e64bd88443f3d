import io

from flashdraft.progress import Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_into_a_log_writes_whole_lines_without_carriage_returns():
    log = io.StringIO()
    for _ in Progress(range(500), desc="train", file=log):
        pass
    text = log.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert 1 <= len(lines) <= 3 and lines[-1].startswith("train: 100%| 500/500")


def test_progress_on_a_terminal_is_tqdms_redrawn_bar():
    screen = Terminal()
    for _ in Progress(range(3), desc="train", file=screen, mininterval=0):
        pass
    assert "\r" in screen.getvalue()


def test_a_finished_bar_in_a_log_ends_with_one_100_percent_line():
    log = io.StringIO()
    with Progress(total=4, desc="cache", file=log, mininterval=0) as bar:
        for _ in range(4):
            bar.update(1)
        bar.set_postfix(loss="1.0")  # a redraw of the finished bar, then close() draws it again
    finished = [line for line in log.getvalue().splitlines() if "100%" in line]
    assert len(finished) == 1, log.getvalue()
