"""What a hung role's failure quotes: the whole stack dump it printed as it was killed."""

from __future__ import annotations

from relax.services.launchers.role_process import _hung_error


class _Log:
    def __init__(self, path: str):
        self.path = path

    def files(self) -> list[str]:
        return [self.path]


def test_the_failure_quotes_every_thread_of_the_last_dump_and_says_when_there_is_none(tmp_path):
    log = tmp_path / "0.log"
    log.write_text("step 3 done\nThread 0x00007f01 (most recent call first):\n  File \"a.py\", line 1 in wait\n\n"
                   "Current thread 0x00007f02 (most recent call first):\n  File \"b.py\", line 2 in step\n")
    quoted = _hung_error(_Log(str(log)))
    assert quoted.startswith("(its stacks as it was killed)\nThread 0x00007f01")  # the first thread, not the last
    assert "line 2 in step" in quoted and "step 3 done" not in quoted
    log.write_text("step 3 done\n")
    assert _hung_error(_Log(str(log))) == "(it printed no stacks: it did not answer SIGUSR1)"
