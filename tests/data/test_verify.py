"""The verify command: counts per domain and class, and the comparison with published totals."""

import os
import subprocess
import sys

from data_fixtures import write_image

from sagm_jax.data import verify

VLCS = {"Caltech101": 1415, "LabelMe": 2656, "SUN09": 3282, "VOC2007": 3376}


def make_vlcs_like(root, per_class=2):
    for d_index, domain in enumerate(VLCS):
        for c in range(5):
            for k in range(per_class + d_index):
                write_image(
                    os.path.join(root, "VLCS", domain, f"class{c}", f"{k}.jpg"),
                    (20, 16),
                    k + 100 * c + 1000 * d_index,
                    "JPEG",
                )


def test_verify_prints_counts_and_fails_on_mismatch(tmp_path, capsys):
    make_vlcs_like(str(tmp_path))
    code = verify.main(["--dataset=VLCS", f"--data_dir={tmp_path}", "--no_cache"])
    out = capsys.readouterr().out
    assert code == 1
    assert "Caltech101: 10 images" in out and "LabelMe: 15 images" in out
    assert "class3" in out and "total: 70 images, 5 classes" in out
    assert "MISMATCH: domain 'Caltech101': 10 images != published 1415" in out
    assert "MISMATCH: 70 images != published 10729" in out


def test_verify_prints_the_counts_of_another_layout_before_its_differences(tmp_path, capsys):
    make_vlcs_like(str(tmp_path))
    os.rename(tmp_path / "VLCS" / "SUN09", tmp_path / "VLCS" / "SUN")  # a domain named otherwise
    code = verify.main(["--dataset=VLCS", f"--data_dir={tmp_path}", "--no_cache"])
    out = capsys.readouterr().out
    assert code == 1
    assert "SUN: 20 images" in out and "total: 70 images, 5 classes" in out
    assert "MISMATCH: domains ['Caltech101', 'LabelMe', 'SUN', 'VOC2007']" in out


def test_compare_accepts_published_counts():
    spec = verify.registry.get_spec("VLCS")
    counts = {d: {f"c{k}": n // 5 + (k < n % 5) for k in range(5)} for d, n in VLCS.items()}
    fp = {"counts": counts, "domain_totals": dict(VLCS), "total": 10729}
    assert verify.compare(spec, fp) == []
    fp["domain_totals"] = dict(VLCS, SUN09=3281)
    assert len(verify.compare(spec, fp)) == 1


def test_verify_command_missing_data_exits_nonzero(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "sagm_jax.data.verify", "--dataset=PACS", f"--data_dir={tmp_path}"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert "PACS/<domain>/<class>/<image>" in result.stderr
