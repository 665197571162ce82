"""The patch registry: every Keras / TensorFlow target tfdist changes still
exists with the signature it expects, and install / uninstall restore the
very objects they replaced."""

import functools

import keras
import pytest

from tfdist._compat import patches

ALL_PROCESS_WIDE = patches.PROCESS_WIDE + patches.OPTIONAL


@pytest.mark.parametrize("patch", patches.PROCESS_WIDE + patches.OPTIONAL + patches.PER_OBJECT,
                         ids=lambda patch: patch.target)
def test_target_has_the_expected_signature(patch):
    assert patch.current_signature() == patch.signature


def test_install_then_uninstall_restores_the_originals():
    already = {p: getattr(p.owner, p.attribute)
               for p in ALL_PROCESS_WIDE if patches.installed(p)}
    for patch in already:  # installed by an earlier test of this process
        patches.uninstall(patch)
    originals = {p: getattr(p.owner, p.attribute) for p in ALL_PROCESS_WIDE}
    owned = {p: vars(p.owner).get(p.attribute) for p in ALL_PROCESS_WIDE}
    try:
        for patch in ALL_PROCESS_WIDE:
            patches.install(patch, lambda original: functools.wraps(original)(
                lambda *args, **kwargs: original(*args, **kwargs)))
            assert getattr(patch.owner, patch.attribute) is not originals[patch]
            assert patches.installed(patch)
        for patch in ALL_PROCESS_WIDE:
            patches.uninstall(patch)
            assert not patches.installed(patch)
            assert vars(patch.owner).get(patch.attribute) is owned[patch]
            assert getattr(patch.owner, patch.attribute) is originals[patch]
    finally:
        for patch, replacement in already.items():  # as they were
            patches.install(patch, lambda original, replacement=replacement: replacement)


def test_install_is_once_per_process():
    was_installed = patches.installed(patches.MODEL_SUMMARY)
    patches.uninstall(patches.MODEL_SUMMARY)
    original = keras.Model.summary
    try:
        patches.install(patches.MODEL_SUMMARY, lambda summary: "first")
        patches.install(patches.MODEL_SUMMARY, lambda summary: "second")
        assert keras.Model.summary == "first"
    finally:
        patches.uninstall(patches.MODEL_SUMMARY)
    assert keras.Model.summary is original
    if was_installed:
        from tfdist.pipeline import summary
        summary.install()


def test_only_registered_process_wide_patches_install():
    per_object = patches.PER_OBJECT[0]
    with pytest.raises(ValueError, match="PROCESS_WIDE"):
        patches.install(per_object, lambda original: original)


def test_a_changed_target_is_reported():
    gone = patches.Patch(keras.Model, "no_such_method", "(self)", "nowhere")
    with pytest.raises(AttributeError):
        gone.current_signature()
    moved = patches.Patch(keras.Model, "summary", "(self)", "nowhere")
    assert moved.current_signature() != moved.signature
