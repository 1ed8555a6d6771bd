"""Which module globals a user function's code reads, which attributes of `self` and of
`super()` a method's code reads, and whether that code is a library's.

A map's or filter's fingerprint (`_fingerprint._fingerprint_callable`) writes the values of the
globals its code reads: `MAX_LEN = 2048` changed to 4096 at module level leaves the function's
source as it was; and a method's source leaves out the methods it calls on `self` (`self.helper(x)`,
`getattr(self, "helper")(x)`) and on `super()`. It follows the functions it reaches these ways only
into the user's own code. A function of the standard library or of another installed package is
named, not followed: its module's globals are the library's state (`re` keeps the patterns
programs compiled in one, so a fingerprint reading it would change as the program runs), its call
graph may hold thousands of functions, and its source differs between Python builds and library
versions, which would refuse a checkpoint resumed on another interpreter.
"""

from __future__ import annotations

import dis
import functools
import os
import site
import sysconfig
import types
from collections.abc import Iterator

__all__ = [
    "attributes_read_on_first_argument", "attributes_read_on_super", "globals_read", "is_library_code",
    "names_got_on_first_argument",
]

_LOADS_A_GLOBAL = frozenset({"LOAD_GLOBAL", "LOAD_NAME", "LOAD_FROM_DICT_OR_GLOBALS"})
_LOADS_AN_ATTRIBUTE = frozenset({"LOAD_ATTR", "LOAD_METHOD"})
_BEFORE_A_CALL = frozenset({"PRECALL", "PUSH_NULL", "EXTENDED_ARG", "CACHE"})
_TWO_ARGUMENT_SUPER = 2
"""The bit of `LOAD_SUPER_ATTR`'s argument set for `super(cls, obj).name`, unset for `super().name`."""


def globals_read(code: types.CodeType) -> list[str]:
    """The names `code` and the code nested in it (inner functions, lambdas, comprehensions,
    generator expressions) load as globals, sorted so that the fingerprint lists them alike in
    every process.

    Read from the bytecode rather than `co_names`, which also holds every attribute name the code
    uses (`record.get`, `np.clip`): a module global that happened to share one would enter the
    recipe. An inner function's annotations are read too: 3.11 evaluates them in the enclosing
    code, 3.14 in `__annotate__` code nested in it, so taking both keeps one fingerprint on both.
    """
    return sorted({op.argval for current in _with_nested(code) for op in dis.get_instructions(current)
                   if op.opname in _LOADS_A_GLOBAL})


def attributes_read_on_first_argument(code: types.CodeType) -> list[str]:
    """The attribute names `code` (a method's) and the code nested in it load on its first
    argument, `self.helper` of `self.helper(x)`, sorted; empty for code without arguments.

    Found by name, not by offset, so that 3.11 and 3.14 agree where their bytecode differs: an
    attribute load right after a load of a local or a closure variable of that name (3.11 loads
    `self` as `LOAD_FAST`, 3.14 as `LOAD_FAST_BORROW` or as the second of a `LOAD_FAST_LOAD_FAST`
    pair, and a lambda or a 3.11 comprehension reads it from its closure). `super().helper` is
    another load (`LOAD_SUPER_ATTR` on 3.12+, an attribute of `super()` before) and is not one.
    """
    if code.co_argcount + code.co_kwonlyargcount == 0:
        return []
    first = code.co_varnames[0]
    names: set[str] = set()
    for current in _with_nested(code):
        loaded_first = False
        for op in dis.get_instructions(current):
            if op.opname == "EXTENDED_ARG":  # the prefix of a large argument, not an instruction of its own
                continue
            if op.opname in _LOADS_AN_ATTRIBUTE and loaded_first:
                names.add(op.argval)
            loaded_first = _loads_variable(op, first)
    return sorted(names)


def names_got_on_first_argument(code: types.CodeType) -> list[str]:
    """The names `code` (a method's) and the code nested in it read on its first argument with
    `getattr` and the name written in the call: `getattr(self, "helper")` or `getattr(self,
    "LIMIT", default)` where the default is one load (a constant, a variable), sorted; empty for
    code without arguments. `getattr` is the name the code loads as a global, which the caller
    checks is the builtin's.

    Matched whole, from the load of `getattr` to the call, so that a name only begun there
    (`getattr(self, "a" + suffix)`) or a default computed in more steps is not taken. 3.11
    prefixes the call with `PUSH_NULL` and `PRECALL`, left out; 3.14 loads `self` as
    `LOAD_FAST_BORROW` and a small default as `LOAD_SMALL_INT`.
    """
    if code.co_argcount + code.co_kwonlyargcount == 0:
        return []
    first = code.co_varnames[0]
    names: set[str] = set()
    for current in _with_nested(code):
        ops = [op for op in dis.get_instructions(current) if op.opname not in _BEFORE_A_CALL]
        for i, op in enumerate(ops):
            if op.opname not in _LOADS_A_GLOBAL or op.argval != "getattr":
                continue
            target, name, *rest = ops[i + 1 : i + 5] + [None, None]  # None: the code ended
            if not (target and name and _loads_variable(target, first) and name.opname == "LOAD_CONST"):
                continue
            if isinstance(name.argval, str) and (
                _is_call(rest[0], 2) or (rest[0] and _loads_one_value(rest[0]) and _is_call(rest[1], 3))
            ):
                names.add(name.argval)
    return sorted(names)


def _loads_variable(op: dis.Instruction, name: str) -> bool:
    """Whether `op` loads the local or closure variable `name` (as the second of a 3.14 pair too)."""
    if not (op.opname.startswith("LOAD_FAST") or op.opname == "LOAD_DEREF"):
        return False
    return (op.argval[-1] if isinstance(op.argval, tuple) else op.argval) == name


def _loads_one_value(op: dis.Instruction) -> bool:
    """Whether `op` alone pushes a value: a constant, a global, a local or closure variable."""
    return op.opname in ("LOAD_CONST", "LOAD_SMALL_INT", "LOAD_DEREF") or op.opname in _LOADS_A_GLOBAL or (
        op.opname.startswith("LOAD_FAST") and not isinstance(op.argval, tuple)
    )


def _is_call(op: dis.Instruction | None, arguments: int) -> bool:
    return op is not None and op.opname == "CALL" and op.arg == arguments


def attributes_read_on_super(code: types.CodeType) -> list[tuple[str, str]]:
    """What `code` (a method's) and the code nested in it load on `super()`, as (the variable
    holding the class `super` starts after, the attribute name) pairs, sorted:
    `("__class__", "helper")` for `super().helper(x)` (Python hands a method using `super()` its
    class in a `__class__` cell), `("Cleaner", "helper")` for `super(Cleaner, self).helper(x)`
    made with the method's first argument; empty for neither.

    Found by name, so that 3.11 and 3.14 agree where their bytecode differs: 3.12+ compiles it to
    loads of `super`, of the class and of the first argument, then one `LOAD_SUPER_ATTR` (whose
    argument says whether `super` was given arguments); 3.11 (and 3.12+ in code without
    arguments) to loads of `super` and of its arguments, a call and an attribute load.
    """
    first = code.co_varnames[0] if code.co_argcount + code.co_kwonlyargcount else None
    reads: set[tuple[str, str]] = set()
    for current in _with_nested(code):
        step, held = None, None  # how far a `super(...)` is made, and the variable holding its class
        for op in dis.get_instructions(current):
            if op.opname in _BEFORE_A_CALL:
                continue
            if op.opname == "LOAD_SUPER_ATTR":
                if not op.arg & _TWO_ARGUMENT_SUPER:
                    reads.add(("__class__", op.argval))
                elif step == "arguments":
                    reads.add((held, op.argval))
            elif op.opname in _LOADS_AN_ATTRIBUTE and step == "called":
                reads.add((held, op.argval))
            variable = op.opname in _LOADS_A_GLOBAL or op.opname == "LOAD_DEREF"
            if op.opname in _LOADS_A_GLOBAL and op.argval == "super":
                step, held = "super", None
            elif step == "super" and variable:
                step, held = "class", op.argval
            elif step == "class" and op.argval == first and (variable or op.opname.startswith("LOAD_FAST")):
                step = "arguments"
            elif op.opname == "CALL" and (step, op.arg) in (("super", 0), ("arguments", 2)):
                step, held = "called", held or "__class__"
            else:
                step, held = None, None
    return sorted(reads)


def _with_nested(code: types.CodeType) -> Iterator[types.CodeType]:
    """`code`, then every code object nested in it at any depth (inner functions, lambdas,
    comprehensions, generator expressions, 3.14's `__annotate__`)."""
    pending = [code]
    while pending:
        current = pending.pop()
        yield current
        pending.extend(c for c in current.co_consts if isinstance(c, types.CodeType))


def is_library_code(code: types.CodeType) -> bool:
    """Whether `code` was loaded from the standard library or an installed package (site-packages,
    frozen modules included). Code compiled from a string (`<string>`, a notebook cell) is the user's."""
    filename = code.co_filename
    if filename.startswith("<"):
        return filename.startswith("<frozen ")
    return os.path.realpath(filename).startswith(_library_roots())


@functools.cache
def _library_roots() -> tuple[str, ...]:
    """The folders the standard library and installed packages are loaded from, each ending in a
    separator so that `/usr/lib/python3.11` does not hold `/usr/lib/python3.11-user`."""
    paths = sysconfig.get_paths()
    roots = {paths[name] for name in ("stdlib", "platstdlib", "purelib", "platlib") if name in paths}
    roots.update(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        roots.add(site.getusersitepackages())
    return tuple(sorted(os.path.join(os.path.realpath(root), "") for root in roots))
