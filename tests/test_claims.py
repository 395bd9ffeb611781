"""sagm_jax.claims: exclusive, released when the holder dies (SIGKILL too), shared with a
child that inherits the descriptor."""

import signal
import subprocess
import sys
import time

from sagm_jax import claims

HOLD = """
import sys, time
from sagm_jax import claims
claim = claims.try_claim(sys.argv[1], "x.lock")
print("held" if claim else "refused", flush=True)
time.sleep(60)
"""

def hold_in_another_process(directory):
    process = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(directory)], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout.readline().strip() == "held"
    return process


def test_a_claim_is_exclusive_and_released_by_its_holders_death(tmp_path):
    holder = hold_in_another_process(tmp_path)
    try:
        assert claims.try_claim(str(tmp_path), "x.lock") is None
        assert claims.is_claimed(str(tmp_path), "x.lock")
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with claims.try_claim(str(tmp_path), "x.lock") as claim:
        assert claim is not None and claims.is_claimed(str(tmp_path), "x.lock")
        assert claims.try_claim(str(tmp_path), "x.lock") is None  # even in the same process
    assert not claims.is_claimed(str(tmp_path), "x.lock")
    assert not claims.is_claimed(str(tmp_path), "never.lock")


def test_a_child_that_inherits_the_claim_keeps_it_after_its_parent_dies(tmp_path):
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys\n"
            "from sagm_jax import claims\n"
            "c = claims.try_claim(sys.argv[1], 'x.lock')\n"
            "child = subprocess.Popen(['sleep', '3'], pass_fds=(c.fileno(),))\n"
            "print(child.pid, flush=True)\n"
            "import time; time.sleep(60)",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert int(parent.stdout.readline()) > 0  # the child runs
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    assert claims.is_claimed(str(tmp_path), "x.lock")  # the child still holds it
    deadline = time.monotonic() + 30
    while claims.is_claimed(str(tmp_path), "x.lock") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not claims.is_claimed(str(tmp_path), "x.lock")  # released when the child ended
