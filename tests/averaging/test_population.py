"""Populations (sagm_jax.averaging.population): a DiWA population of SAGM runs on
RotatedDigits, its shared start checked bit for bit against the probe's checkpoint, its
members packed, its soups written; killed in the middle, the relaunch ends with the same
runs and soups, bit for bit."""

import json
import os

import jax
import numpy as np
import pytest
from flax import traverse_util
from run_fixtures import digits_config

from sagm_jax.averaging import population
from sagm_jax.training import checkpoints, packed, train
from sagm_jax.training.rundir import read_records

MEMBERS = 2


def _config():
    return digits_config(algorithm="sagm", steps=3)


def _run(workdir):
    return population.run_population(_config(), str(workdir), "diwa", members=MEMBERS, pack=2,
                                     linear_probe_steps=2)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("population")
    return workdir, _run(workdir)


def _flat(variables):
    return traverse_util.flatten_dict(jax.device_get(variables), sep="/")


def test_every_member_starts_bit_identical_to_the_probed_start(reference):
    workdir, _ = reference
    start = str(workdir / "init")
    probed = checkpoints.restore_variables(start, 1)  # the probe's last step
    configs = []
    for path in population.member_dirs(str(workdir), MEMBERS):
        with open(os.path.join(path, "run_info.json")) as f:
            assert json.load(f)["init"]["sha256"] == checkpoints.weights_sha256(probed)
        with open(os.path.join(path, "config.json")) as f:
            configs.append(train.ml_collections.ConfigDict(json.load(f)))
    # The members' step-0 states as the pack builds them: each lane is the probe's weights.
    variables = [train.open_run(c)[1] for c in configs]
    states = packed.packed_initial_states(configs[0], packed.varying_values(configs), variables,
                                          num_domains=5)
    want = _flat(probed["params"])
    for lane in range(MEMBERS):
        got = _flat(jax.tree.map(lambda x, r=lane: x[r], states.params))
        assert got.keys() == want.keys()
        for key in want:
            assert np.array_equal(got[key], want[key]), (lane, key)
    # The probe trained the classifier alone: its featurizer is the network's initialisation.
    _, fresh = train.open_run(population.probe_config(_config(), 2))
    fresh = _flat(fresh["params"])
    for key in want:
        same = np.array_equal(fresh[key], want[key])
        assert same != key.startswith("classifier/"), key
    assert configs[0].lr != configs[1].lr or configs[0].weight_decay != configs[1].weight_decay


def test_the_population_writes_its_soups_under_their_labels(reference, capsys):
    workdir, averages = reference
    assert averages["soup_uniform"]["algorithm"] == "SAGM + DiWA (uniform)"
    assert averages["soup_greedy"]["algorithm"] == "SAGM + DiWA (greedy)"
    assert sorted(averages["soup_uniform"]["soup"]["accepted"]) == [0, 1]
    lines = population.report(population.member_dirs(str(workdir), MEMBERS), averages)
    assert "member1" in lines and "soup_greedy (SAGM + DiWA (greedy))" in lines
    # A relaunch of the finished population reads its soups back.
    again = _run(workdir)
    for name, record in averages.items():
        assert {k: again[name][k] for k in ("algorithm", "env0_in_acc", "soup")} == {
            k: json.loads(json.dumps(record[k])) for k in ("algorithm", "env0_in_acc", "soup")}
    capsys.readouterr()


def test_a_population_killed_in_a_members_save_ends_with_the_same_runs_and_soups(
        reference, tmp_path, monkeypatch):
    workdir, averages = reference
    save = checkpoints.Checkpoints.save
    second = os.path.join(population.member_dirs(str(tmp_path), MEMBERS)[1], "checkpoints")

    def stop_at_the_second_members_step_2(self, step, *args, **kwargs):
        if step == 2 and self.directory == second:
            raise KeyboardInterrupt
        return save(self, step, *args, **kwargs)

    monkeypatch.setattr(checkpoints.Checkpoints, "save", stop_at_the_second_members_step_2)
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path)
    monkeypatch.setattr(checkpoints.Checkpoints, "save", save)
    resumed = _run(tmp_path)
    for ours, theirs in zip(population.member_dirs(str(tmp_path), MEMBERS),
                            population.member_dirs(str(workdir), MEMBERS)):
        strip = lambda r: {k: v for k, v in r.items()
                           if k == "step" or k.endswith(("_acc", "_loss")) or k == "loss"}
        assert [strip(r) for r in read_records(ours)] == [strip(r) for r in read_records(theirs)]
    for name in ("soup_uniform", "soup_greedy"):
        for key in ("env0_in_acc", "env1_out_acc", "loss"):
            assert resumed[name][key] == averages[name][key], (name, key)
        step = resumed[name]["step"]
        got = _flat(checkpoints.restore_variables(str(tmp_path / name), step))
        want = _flat(checkpoints.restore_variables(str(workdir / name), step))
        for key in want:
            assert np.array_equal(got[key], want[key]), (name, key)


def _reference_featurizer_aux(aux_dir_folders, target, hparams_seed):
    """facebookresearch/ModelRatatouille ``misc.get_featurizer_aux`` re-stated: the
    auxiliary folders (sorted, those of the target dataset left out), folder
    ``hparams_seed % (F + 1)`` (0: ImageNet's), its finished runs (sorted), run
    ``hparams_seed % (their number)``."""
    folders = sorted(f for f, dataset in aux_dir_folders.items() if dataset != target)
    index = hparams_seed % (len(folders) + 1)
    if index == 0:
        return None
    runs = sorted(os.path.join(folders[index - 1], name)
                  for name in os.listdir(folders[index - 1])
                  if os.path.exists(os.path.join(folders[index - 1], name, "done")))
    return runs[hparams_seed % len(runs)]


def test_each_ratatouille_member_takes_the_auxiliary_run_the_reference_picks(tmp_path):
    folders = {}
    for dataset, runs, finished in (("VLCS", 3, 3), ("OfficeHome", 2, 1), ("PACS", 2, 2),
                                    ("RotatedDigits", 2, 2)):
        folder = tmp_path / dataset
        for r in range(runs):
            run = folder / f"run{r}"
            run.mkdir(parents=True)
            (run / "config.json").write_text(json.dumps({"dataset": dataset}))
            if r < finished:
                (run / "done").write_text("")
        folders[str(folder)] = dataset
    for k in range(1, 13):
        assert population.auxiliary_run(list(folders), "RotatedDigits", k) == (
            _reference_featurizer_aux(folders, "RotatedDigits", k)), k
    assert population.auxiliary_run(list(folders), "RotatedDigits", 4) is None  # ImageNet's
