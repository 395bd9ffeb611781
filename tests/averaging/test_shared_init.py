"""A run starting from another run's weights (sagm_jax.averaging.shared_init): DiWA's shared
initialisation (every network variable, same data) and Model Ratatouille's auxiliary
featurizer (all but the classifier, another dataset), checked bit for bit against the
parent's checkpoint as orbax stored it."""

import jax
import numpy as np
import pytest
from flax import traverse_util
from run_fixtures import digits_config, tiny_folder_config, write_image_tree

from sagm_jax.training import checkpoints, train


def _flat(variables):
    return traverse_util.flatten_dict(jax.device_get(variables), sep="/")


@pytest.fixture(scope="module")
def parent(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("parent"))
    train.train_one_run(digits_config(steps=3), workdir)
    return workdir


def test_a_child_starts_bit_identical_to_its_parents_last_weights(parent):
    config = digits_config(init_from=parent, lr=3e-4)
    program, variables = train.open_run(config)
    stored = checkpoints.restore_variables(parent, max(checkpoints.saved_steps(parent)))
    ours, theirs = _flat(variables), _flat(stored)
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert np.array_equal(ours[key], theirs[key]), key
    recorded = program.run_info["init"]
    assert recorded["weights"] == "last" and recorded["step"] == 2
    assert recorded["sha256"] == checkpoints.weights_sha256(stored)
    # Without init_from, the network's own initialisation.
    _, fresh = train.open_run(digits_config(lr=3e-4))
    assert not np.array_equal(_flat(fresh)["params/classifier/kernel"],
                              ours["params/classifier/kernel"])


def test_a_start_on_other_held_out_environments_or_unfinished_is_refused(parent, tmp_path):
    with pytest.raises(ValueError, match=r"held-out environments \(0,\), not \(1,\)"):
        train.open_run(digits_config(init_from=parent, test_envs=(1,)))
    # RotatedDigits' environments are shuffled by the run's seed, as DomainBed's MNIST.
    with pytest.raises(ValueError, match="other data"):
        train.open_run(digits_config(init_from=parent, seed=7))
    with pytest.raises(ValueError, match="not a run directory"):
        train.open_run(digits_config(init_from=str(tmp_path)))
    with pytest.raises(ValueError, match="another dataset"):
        train.open_run(digits_config(init_featurizer_from=parent))


def test_a_ratatouille_child_takes_the_auxiliary_featurizer_and_keeps_its_classifier(tmp_path):
    write_image_tree(tmp_path / "aux", domains=("p", "q"), classes=("a", "b", "c"), n=3)
    write_image_tree(tmp_path / "data", domains=("r", "s"), classes=("u", "v"), n=3)
    aux = str(tmp_path / "aux_run")
    aux_config = tiny_folder_config(tmp_path, num_devices=1, data_dir=str(tmp_path / "aux"), test_envs=(),
                                    steps=2, eval_every=1)
    train.train_one_run(aux_config, aux)
    child = tiny_folder_config(tmp_path, num_devices=1, test_envs=(0,), init_featurizer_from=aux)
    _, variables = train.open_run(child)
    _, fresh = train.open_run(tiny_folder_config(tmp_path, num_devices=1, test_envs=(0,)))
    stored = _flat(checkpoints.restore_variables(aux, 1))
    ours, fresh = _flat(variables), _flat(fresh)
    assert stored["params/classifier/kernel"].shape[-1] == 3  # the auxiliary's three classes
    for key in ours:
        expected = fresh[key] if key.startswith("params/classifier/") else stored[key]
        assert np.array_equal(ours[key], expected), key
    with pytest.raises(ValueError, match="held-out environments"):
        train.open_run(tiny_folder_config(tmp_path, num_devices=1, data_dir=str(tmp_path / "aux"),
                                          test_envs=(0,), init_from=aux))
