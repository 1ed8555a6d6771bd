"""`zephon._fork`: what a forked child renews, and what the registries let go.

A lock is held as a fork copies it by acquiring it in the parent before forking: the child's copy
is then held with no thread of the child to release it, as one held by another thread of the
parent is. The child tries it without blocking, so a lock left unrenewed fails the test at once.
"""

from __future__ import annotations

import gc
import threading
import weakref
from pathlib import Path

import pytest

from tests.unit.test_loader_fork import run_in_a_child, what_the_child_wrote
from zephon import _fork

pytestmark = pytest.mark.filterwarnings("ignore:This process .* is multi-threaded, use of fork:DeprecationWarning")


class _Owner:
    """An object with a lock of its own, renewed in a forked child."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        _fork.renew_in_child(self, _Owner.new_lock)

    def new_lock(self) -> None:
        self.lock = threading.Lock()


class _EqualOwner(_Owner):
    """Equal to every other, as a value object is: still an owner of its own."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _EqualOwner)

    def __hash__(self) -> int:
        return 0


def _in_a_child_holding(owners, work, tmp_path):
    """Fork while each owner's lock is held; what `work()` returned in the child."""
    for owner in owners:
        owner.lock.acquire()
    try:
        code = run_in_a_child(work, tmp_path / "child.json")
    finally:
        for owner in owners:
            owner.lock.release()
    return what_the_child_wrote(code, tmp_path / "child.json")


def _take_each(owners) -> list[bool]:
    return [owner.lock.acquire(blocking=False) for owner in owners]


def test_a_child_forked_while_an_owners_lock_is_held_takes_a_new_one(tmp_path):
    owner = _Owner()
    assert _in_a_child_holding([owner], lambda: _take_each([owner]), tmp_path) == [True]


def test_owners_equal_to_one_another_each_get_a_new_lock_in_a_child(tmp_path):
    """Kept by equality, one equal owner would stand for all: the others' locks stay held in the child."""
    owners = [_EqualOwner(), _EqualOwner()]
    assert _in_a_child_holding(owners, lambda: _take_each(owners), tmp_path) == [True, True]


def test_an_owner_let_go_is_collected_and_leaves_the_registry():
    """A renewal holds its owner weakly: a dropped loader is still collected (its finalizer closes
    its runner), and owners come and go for the life of a process without the registry growing."""
    before = len(_fork._renewals)
    owners = [_Owner() for _ in range(100)]
    gone = [weakref.ref(owner) for owner in owners]
    del owners
    gc.collect()
    assert [ref() for ref in gone] == [None] * 100
    assert len(_fork._renewals) <= before


def test_renewing_an_owner_with_a_method_bound_to_it_is_refused():
    """The registry holds a renewal as long as its owner lives: bound to the owner, it would keep
    the owner alive for ever."""
    owner = _Owner()
    with pytest.raises(TypeError, match="_Owner's function"):
        _fork.renew_in_child(owner, owner.new_lock)


def test_a_renewal_or_hook_that_raises_leaves_the_others_to_run_in_the_child(tmp_path, monkeypatch):
    """Each renewal may be a lock the child would otherwise wait on for ever."""
    monkeypatch.setattr(_fork, "_hooks", [*_fork._hooks])
    ran = []

    def fails(_owner=None) -> None:
        raise RuntimeError("a renewal that fails")

    failing = _Owner()
    _fork.renew_in_child(failing, fails)
    _fork.call_in_child(fails)
    _fork.call_in_child(lambda: ran.append("the hook after"))
    owner = _Owner()
    owners = [failing, owner]
    assert _in_a_child_holding(owners, lambda: [*_take_each(owners), *ran], tmp_path) == [True, True, "the hook after"]


def test_zephon_its_runners_and_vlm_register_no_fork_handler_but_the_one_in_zephon_fork():
    """A handler of their own could never be removed and would run in an order no one chose; the
    process runner's reaping of abandoned workers once registered one beside this module's."""
    root = Path(_fork.__file__).parents[1]
    sources = [path for package in ("zephon", "runners", "vlm") for path in (root / package).rglob("*.py")]
    registering = sorted(
        str(path.relative_to(root)) for path in sources
        if "register_at_fork(" in path.read_text(encoding="utf-8"))
    assert registering == ["zephon/_fork.py"]
