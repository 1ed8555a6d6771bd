"""How a user's function and the values it holds enter the recipe: the same writing in every
process, on every interpreter build and in every run.

A checkpoint names the recipe that made it, map and filter functions included, and a resumed run
(another process, host, or a 3.14t build beside 3.11) must write that recipe exactly as the saving
run did, or the checkpoint is refused; a changed function written alike would be accepted.
`repr` is no such identity: it holds memory addresses, lists a set in a per-process hash order and
elides and rounds arrays. So a function is written by its name, the hash of its source and what it
holds and reads (`_fingerprint_callable`; `_code_reads` finds what its code reads), and a value by
its content (`stable_description`, which `vlm` uses for its processors' settings too). It is kept
apart from the operators that run those functions (`_record_ops`) because its contract is another:
a change to what it writes changes recipe digests, and every checkpoint saved before is refused.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import re
import sys
import types
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ._code_reads import (
    attributes_read_on_first_argument, attributes_read_on_super, globals_read, is_library_code,
    names_got_on_first_argument,
)
from ._sha256 import sha256

__all__ = ["stable_description"]


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _defining(fn: Callable):
    """What defines `fn` by name and source: itself, or for a callable object its class. A
    decorator's wrapper object is one, though `functools.update_wrapper` gave it the name of the
    function it wraps."""
    return fn if hasattr(fn, "__qualname__") and _wrapped(fn) is None else type(fn)


def _wrapped(fn) -> Callable | None:
    """The function a decorator's wrapper object calls, its `__wrapped__` (which `functools.wraps`,
    `update_wrapper`, `lru_cache` and `cache` set): a C `lru_cache` wrapper or a decorator class's
    instance; None for anything else. A Python function wrapping another is not one: it holds the
    other in its closure, which is followed already. Read from the object's `__dict__`, because a
    bound method hands any attribute on to its function and a `__getattr__` may make one up."""
    if isinstance(fn, (types.FunctionType, types.MethodType)):
        return None
    attributes = getattr(fn, "__dict__", None)
    wrapped = attributes.get("__wrapped__") if isinstance(attributes, dict) else None
    return wrapped if callable(wrapped) else None


def _describe_callable(fn: Callable) -> str:
    """A user function's name for messages: a callable object is named by its class, and a
    decorator's wrapper object by its class and the function it wraps."""
    if isinstance(fn, functools.partial):
        return f"functools.partial({_describe_callable(fn.func)})"
    named = _defining(fn)
    described = f"{getattr(named, '__module__', None) or '?'}.{_qualname(named)}"
    wrapped = _wrapped(fn)
    return described if wrapped is None else f"{described}({_describe_callable(wrapped)})"


_INLINED_SCOPES = frozenset({"<listcomp>", "<dictcomp>", "<setcomp>"})


def _qualname(named) -> str:
    """`named.__qualname__` as 3.12+ writes it. 3.11 names a lambda made in a list, dict or set
    comprehension after the comprehension (`<listcomp>.<lambda>`); 3.12+ inlines those
    comprehensions (PEP 709) and leaves them out, so such a filter had one fingerprint on 3.11 and
    another on 3.14t, which refused the other's checkpoints. Only a lambda (or what is nested in
    one) can be made in a comprehension; a generator expression stays a scope on every build."""
    return ".".join(part for part in named.__qualname__.split(".") if part not in _INLINED_SCOPES)


@dataclass(frozen=True)
class _Walk:
    """Where a fingerprint stands among the functions a user function reaches. `within` holds the
    functions and partials being written (by id), so that one reaching itself (directly, through a
    partial or through the globals of another) is written `<itself>` there instead of recursing
    without end. `written` holds the functions written in full already, anywhere in this
    fingerprint (one set for the whole walk; functions compare by identity, and holding them keeps
    their ids from being reused meanwhile), so that helpers reaching a shared helper along many
    paths write it once: written along every path, n levels of them made 2**n writings. `home` is
    the top-level package of the function handed to the loader (None until it is met: a partial's
    function is), whose code is followed wherever it is installed. `instance_class` is, for a
    method followed from another's `self.helper(...)`, the class that call was resolved on: the
    method's own calls on `self` resolve there too (a subclass may override them), so such a
    method is written in full once per class."""

    home: str | None = None
    within: frozenset = frozenset()
    written: set = dataclasses.field(default_factory=set)
    instance_class: type | None = None


def _fingerprint_callable(fn: Callable, _walk: _Walk | None = None) -> str:
    """How a user function enters the recipe, the same in every process and interpreter.

    Its name, the SHA-256 of its source where Python finds it (the same name with an edited body
    is another recipe; not for the `operator` module's callables, whose source only some builds
    find), a `functools.partial`'s arguments, a callable object's configuration and
    a bound method's instance (`Cleaner(min_length=5).keep`, `stop_words.__contains__`), each
    written by `_stable_repr` with any memory address taken out: an address differs in every
    process, so a resumed run would never match its checkpoint. The code a call runs (the
    function, a bound method's function, a callable object's `__call__`) adds its closure, its
    default argument values and the module globals it reads, as `_captured`, `_defaults` and
    `_globals` write them: the values they hold when the loader is built (a default is evaluated
    where the function is defined, so `def keep(r, n=LIMIT)` keeps its source when `LIMIT`
    changes, and so does a function reading `MAX_LEN` when `MAX_LEN` does). A decorator's wrapper
    object (`lru_cache`, `cache`, a decorator class's instance) adds the function it wraps, written
    like any (`_wrapped`); a wrapper function `functools.wraps` made is hashed by its own source.
    A method (a bound method's, a callable object's `__call__`) adds what it reads on `self` that
    its instance's class defines: the methods it calls, followed alike, and the class's public
    constants (`_read_on_self`); and what it reads on `super()`, where `super()` finds it
    (`_read_on_super`).

    A function of the standard library or of another installed package than the one the loader
    was handed a function of, met inside that function, is written by its name only, and such a
    `__call__` (a library's base class) is not followed (`_code_reads` says why). Not seen: what
    `_written` leaves out.
    """
    _walk = _Walk() if _walk is None else _walk
    function = fn.__func__ if isinstance(fn, types.MethodType) else fn
    if id(function) in _walk.within:
        return "<itself>"
    written_as = fn if _walk.instance_class is None else (fn, _walk.instance_class)
    if isinstance(fn, types.FunctionType) and written_as in _walk.written:
        return f"{_describe_callable(fn)} <as above>"
    if isinstance(fn, functools.partial):
        args = stable_description((fn.args, sorted(fn.keywords.items())))
        inner = dataclasses.replace(_walk, within=_walk.within | {id(function)})
        return f"functools.partial({_fingerprint_callable(fn.func, inner)}, {args})"
    described, defining, runs, wrapped = _describe_callable(fn), _defining(fn), _code_run(fn), _wrapped(fn)
    if defining is not fn:
        if wrapped is None or runs is not None:  # a C wrapper's attributes are its cache's, not settings
            described += f" {stable_description(fn)}"
    else:
        owner = getattr(fn, "__self__", None)  # a built-in function's is its module: nothing to add
        if owner is not None and not isinstance(owner, types.ModuleType):
            described += f" of {stable_description(owner)}"
    if wrapped is not None:  # followed like a function, though the decorator is a library's
        inner = dataclasses.replace(_walk, within=_walk.within | {id(function)})
        described += f" wrapping:({_fingerprint_callable(wrapped, inner)})"
    home = _package(defining) if _walk.home is None else _walk.home
    followed = runs is not None and (_package(runs) == home or not is_library_code(runs.__code__))
    if _walk.home is not None and runs is not None and not followed:
        return described  # a library's function, held by the user's
    import inspect  # only pipelines with a map or filter pay its import

    source = None
    # `operator.itemgetter`, `attrgetter`, `methodcaller` are C classes named after pure-Python
    # twins in operator.py: 3.11's `inspect` hashed the twin's source, 3.13+ finds none, so one
    # recipe had two fingerprints across builds. They enter by their repr, which shows their keys.
    if getattr(defining, "__module__", None) != "operator":
        try:
            # A function `functools.wraps` made: `inspect` would give the source of the function it
            # wraps (followed through its closure), its code gives its own.
            wraps = isinstance(defining, types.FunctionType) and hasattr(defining, "__wrapped__")
            source = inspect.getsource(defining.__code__ if wraps else defining)
        except (OSError, TypeError):  # built in, or defined where no source file is (exec, -c)
            pass
    if source is not None:
        described += f" source:{sha256(source.encode()).hexdigest()[:16]}"
    if followed:
        inner = _Walk(home=home, within=_walk.within | {id(function)}, written=_walk.written)
        on_self = dataclasses.replace(inner, instance_class=_instance_class(fn, _walk))
        for label, write, walk in (
            ("captured", _captured, inner), ("defaults", _defaults, inner), ("globals", _globals, inner),
            ("self", _read_on_self, on_self), ("super", _read_on_super, on_self),
        ):
            written = write(runs, walk)
            if written:
                described += f" {label}:({written})"
        if runs is fn:  # a function's writing depends on it alone; a method's, on its instance too
            _walk.written.add(written_as)
    return described


def _package(defined) -> str:
    """The top-level package of the module a function or class was defined in."""
    return (getattr(defined, "__module__", None) or "").partition(".")[0]


def _code_run(fn: Callable) -> types.FunctionType | None:
    """The Python function a call of `fn` runs: itself, a bound method's function, or a callable
    object's `__call__`; None where that is built in."""
    if isinstance(fn, types.MethodType):
        fn = fn.__func__
    elif not isinstance(fn, types.FunctionType):
        fn = getattr(type(fn), "__call__", None)
    return fn if isinstance(fn, types.FunctionType) else None


def _instance_class(fn: Callable, walk: _Walk) -> type | None:
    """The class on which `self.helper` in the code a call of `fn` runs is found: a bound method's
    instance's (the class itself for a classmethod's), a callable object's, or for a method
    followed from another's call on `self`, the class that call was found on; None for a function."""
    if isinstance(fn, types.MethodType):
        owner = fn.__self__
        return owner if isinstance(owner, type) else type(owner)
    return walk.instance_class if isinstance(fn, types.FunctionType) else type(fn)


def _read_on_self(function: types.FunctionType, walk: _Walk) -> str:
    """What `function` reads on its first argument (`self.helper(x)`, `self.MIN_WORDS`: the names
    `attributes_read_on_first_argument` gives; `getattr(self, "helper")(x)`: those
    `names_got_on_first_argument` gives, where `getattr` is the builtin, not a global of the
    function's module) that the MRO of `walk.instance_class` defines, as `_class_attributes`
    writes it. A name read both ways is written once, where the sorted names place it."""
    if walk.instance_class is None:
        return ""
    code = function.__code__
    names = set(attributes_read_on_first_argument(code))
    if "getattr" not in function.__globals__:
        names.update(names_got_on_first_argument(code))
    return _class_attributes(sorted(names), walk.instance_class.__mro__, walk)


def _read_on_super(function: types.FunctionType, walk: _Walk) -> str:
    """What `function` reads on `super()` (`super().helper(x)`, `super(Cleaner, self).helper(x)`:
    the pairs `attributes_read_on_super` gives), found where `super()` finds it: in the MRO of
    `walk.instance_class` after the class it starts after (for `super()` the class defining
    `function`, which its closure holds as `__class__`), as `_class_attributes` writes it; the
    two-argument form is written under the class's name. A method found there is followed with the
    same instance class, so that its own calls on `self` resolve on the instance's class and its
    own `super()` after its class."""
    if walk.instance_class is None:
        return ""
    mro = walk.instance_class.__mro__
    parts = []
    for variable, name in attributes_read_on_super(function.__code__):
        after = _class_held(function, variable)
        if after not in mro:
            continue  # not found, or a `super()` that fails when called
        written = _class_attributes([name], mro[mro.index(after) + 1:], walk)
        if written:
            parts.append(written if variable == "__class__" else f"super({after.__qualname__}).{written}")
    return ", ".join(parts)


def _class_held(function: types.FunctionType, variable: str) -> type | None:
    """The class `variable` holds for `function`'s code: a closure's cell (`__class__`, which
    Python hands a method using `super()`), else a module global; None where it holds none."""
    namespace = function.__globals__
    for name, cell in zip(function.__code__.co_freevars, function.__closure__ or ()):
        if name == variable:
            try:
                namespace = {name: cell.cell_contents}
            except ValueError:  # a cell not assigned yet: the class body has not finished running
                return None
    held = namespace.get(variable)
    return held if isinstance(held, type) else None


def _class_attributes(names: list[str], classes: tuple[type, ...], walk: _Walk) -> str:
    """`names` as the first of `classes` (an MRO or its tail) defining each has it, by name. A
    method (`_method_function`) is written as a function is and followed into its own calls on
    `self` and `super()`. Any other public value there (a constant set in the class body, which
    neither the method's source nor its instance's settings show) is written as `_written` writes
    it; a private one (`_seen = {}`) is left out, as state that running changes, and so are slots
    and attributes no class defines (the instance's, which its settings hold)."""
    plain = dataclasses.replace(walk, instance_class=None)
    parts = []
    for name in names:
        found = _class_attribute(classes, name)
        method = _method_function(found)
        if method is not None:
            on = plain if isinstance(found, staticmethod) else walk  # a staticmethod has no `self`
            parts.append(f"{name}={_fingerprint_callable(method, on)}")
        elif found is not _UNSET and not name.startswith("_") and not isinstance(found, _DESCRIPTORS):
            parts.append(f"{name}={_written(found, plain)}")
    return ", ".join(parts)


_DESCRIPTORS = (
    staticmethod, classmethod, property, functools.cached_property, types.MemberDescriptorType,
    types.GetSetDescriptorType,
)
"""Class attributes that give an instance something else than themselves."""


def _method_function(found) -> Callable | None:
    """The user function a class attribute runs when read on an instance: a method, a
    classmethod's or a staticmethod's function, a property's or a `cached_property`'s getter, a
    decorator's wrapper object; None for anything else."""
    if isinstance(found, (staticmethod, classmethod)):
        found = found.__func__
    elif isinstance(found, property):
        found = found.fget
    elif isinstance(found, functools.cached_property):
        found = found.func
    return found if isinstance(found, types.FunctionType) or _wrapped(found) is not None else None


def _class_attribute(classes: tuple[type, ...], name: str):
    """What `name` is in the first of `classes` (an MRO or its tail) that defines it, unbound;
    `_UNSET` if none does."""
    for defining in classes:
        if name in vars(defining):
            return vars(defining)[name]
    return _UNSET


def _captured(function: types.FunctionType, walk: _Walk) -> str:
    """The values a closure's cells hold, by the names it uses for them, as `_written` writes them."""
    parts = []
    for name, cell in zip(function.__code__.co_freevars, function.__closure__ or ()):
        try:
            value = cell.cell_contents
        except ValueError:  # a cell not assigned yet
            parts.append(f"{name}=<empty>")
            continue
        parts.append(f"{name}={_written(value, walk)}")
    return ", ".join(parts)


def _defaults(function: types.FunctionType, walk: _Walk) -> str:
    """A function's default argument values, positional then keyword-only, by their parameters'
    names, as `_written` writes them; keyword-only ones sorted by name."""
    code = function.__code__
    positional = function.__defaults__ or ()
    names = code.co_varnames[code.co_argcount - len(positional):code.co_argcount]
    keyword_only = sorted((function.__kwdefaults__ or {}).items())
    return ", ".join(f"{name}={_written(value, walk)}" for name, value in (*zip(names, positional), *keyword_only))


def _globals(function: types.FunctionType, walk: _Walk) -> str:
    """The module globals `function`'s code reads (`globals_read`), by name, as `_written` writes
    them. Builtins and names its module does not hold are left out, and so are `__dunder__` names:
    `__file__` holds the checkout's path, which the run resuming a checkpoint need not share."""
    namespace = function.__globals__
    parts = []
    for name in globals_read(function.__code__):
        value = namespace.get(name, _UNSET)
        if value is not _UNSET and not (name.startswith("__") and name.endswith("__")):
            parts.append(f"{name}={_written(value, walk)}")
    return ", ".join(parts)


def _written(value, walk: _Walk) -> str:
    """A value a user function holds (in its closure, its defaults or the globals it reads):
    numbers, strings, bytes, arrays, tensors, compiled `re` patterns, enum members, and sets,
    lists, tuples, dicts, dataclasses and plain objects made of those, by `_stable_repr`; functions
    (and partials, bound methods) by their own fingerprint. A class and a module are named. Any
    other value (a tokenizer, a lock: their reprs hold paths, addresses or states) is written by
    its type's name only, so a change inside it is not seen."""
    callables = (types.FunctionType, types.MethodType, types.BuiltinFunctionType, functools.partial)
    if isinstance(value, callables) or _wrapped(value) is not None:
        return _fingerprint_callable(value, walk)
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    if isinstance(value, types.ModuleType):
        return f"<module {value.__name__}>"
    try:
        if _describable(value):
            return stable_description(value)
    except Exception:  # noqa: BLE001 - a repr that fails, a list holding itself: not described
        pass
    return f"<{type(value).__module__}.{type(value).__qualname__}>"


_SCALARS = (type(None), bool, int, float, complex, str, bytes, np.generic)
_PLAIN = frozenset({type(None), bool, int, float, complex, str, bytes})
"""The exact types `repr` writes as `_stable_repr` does, told apart by one look-up: a lookup table
of 10**6 of them was walked item by item through the checks for objects, 2 s per loader built."""
_REPR_INT_BITS = 14_000
"""The longest int, in bits (4,215 decimal digits), that `_stable_repr` writes by `repr`. Longer
ones are written in hex: `repr` refuses an int of over 4,300 digits under Python's default limit
(`sys.set_int_max_str_digits`, per process), and a table holding one was written by its type's
name alone, every edit in it unseen; where the limit was lifted, by value, another recipe."""


def _describable(value) -> bool:
    """Whether `_stable_repr` writes `value` from what it holds alone (see `_written`)."""
    if type(value) in _PLAIN:
        return True
    if isinstance(value, enum.Enum):
        return _describable(value.value)
    if isinstance(value, _SCALARS) or type(value) in (np.ndarray, np.memmap, re.Pattern) or _is_tensor(value):
        return True
    if type(value) in (list, tuple, set, frozenset):
        return all(_describable(item) for item in value)
    if type(value) is dict:
        return all(_describable(k) and _describable(v) for k, v in value.items())
    shown = _shown_attributes(value)
    return shown is not None and all(_describable(v) for _, v in shown)


def stable_description(value) -> str:
    """`_stable_repr(value)` without memory addresses, or its repr where it nests too deep: what a
    fingerprint holds of an object's configuration (a partial's arguments here, an image processor's
    or a placeholder convention's settings in `vlm`)."""
    try:
        return _ADDRESS.sub("", _stable_repr(value))
    except RecursionError:  # a list holding itself, or nesting deeper than the stack
        return _ADDRESS.sub("", repr(value))


def _stable_repr(value) -> str:
    """`repr(value)`, except that a set's items are listed sorted: a set of strings is listed in
    the order their hashes give, salted per process (PYTHONHASHSEED), so a partial holding one
    (stop words) entered the recipe differently in every process. Lists, tuples and dicts are
    walked to reach the sets inside them and written as `repr` writes them. So is a dataclass
    whose repr is the one `dataclasses` writes (a callable object holding its stop words): its
    public fields are written through this function, which changes nothing where none holds a
    set; private ones (`_cache`) are left out, as state that running changes. An object with
    Python's default repr (`<Cleaner object at 0x..>`, no configuration in it) is written like a
    dataclass from its public attributes, in `__dict__` or `__slots__`. A namedtuple with its generated
    repr is written by its fields, like a dataclass. A NumPy array or a torch tensor is written by its content
    (`_array_repr`, `_tensor_repr`), not by its repr, which elides and rounds. A compiled `re`
    pattern is written by its whole pattern and its flags as a number: its repr cuts the pattern
    at 200 characters. An int too long for `repr` (`_REPR_INT_BITS`) is written in hex. An enum
    member is written by its class's module and qualified name, its name and its value: a plain
    `Enum`'s repr is not one `_describable` lets through, and an `IntEnum`'s names no module."""
    kind = type(value)
    if kind is int and value.bit_length() > _REPR_INT_BITS:
        return hex(value)
    if kind in _PLAIN:
        return repr(value)
    if isinstance(value, enum.Enum):
        return f"{kind.__module__}.{kind.__qualname__}.{value.name}({_stable_repr(value.value)})"
    if kind in (set, frozenset):
        if not value:
            return repr(value)
        items = "{" + ", ".join(sorted(_stable_repr(item) for item in value)) + "}"
        return items if kind is set else f"frozenset({items})"
    if kind is list:
        return "[" + ", ".join(_stable_repr(item) for item in value) + "]"
    if kind is tuple:
        inner = ", ".join(_stable_repr(item) for item in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if kind is dict:
        return "{" + ", ".join(f"{_stable_repr(k)}: {_stable_repr(v)}" for k, v in value.items()) + "}"
    if kind is np.ndarray or kind is np.memmap:
        return _array_repr(value)
    if kind is re.Pattern:
        return f"re.compile({value.pattern!r}, flags={value.flags})"
    if _is_tensor(value):
        written = _tensor_repr(value)
        if written is not None:
            return written
    shown = _shown_attributes(value)
    if shown is not None:
        return f"{kind.__qualname__}({', '.join(f'{name}={_stable_repr(v)}' for name, v in shown)})"
    return repr(value)


_UNSET = object()


def _shown_attributes(value) -> list[tuple[str, object]] | None:
    """(name, value) of what a dataclass's (its public fields) or a namedtuple's generated repr
    shows, or of an object's public attributes (`__dict__` and set `__slots__`) where its class
    keeps Python's default repr; None for any other value."""
    kind = type(value)
    if dataclasses.is_dataclass(kind):
        shown = [(f.name, getattr(value, f.name, _UNSET)) for f in dataclasses.fields(value) if f.repr]
        # Private fields (`_seen`) are state that running changes, left out as an object's private
        # attributes are: written, a loader built after the function ran refused its checkpoint.
        public = [(name, v) for name, v in shown if not name.startswith("_")]
        try:
            written = repr(value)
        except AttributeError:
            # The generated repr reads every field, and one declared `init=False` and set on first
            # use is not there yet (building the loader failed on it): the fields set are written.
            return [(name, v) for name, v in public if v is not _UNSET]
        # Only where `repr` gives exactly what dataclasses write: a hand-written __repr__ may show
        # other things, and it is kept as it is.
        if written == f"{kind.__qualname__}({', '.join(f'{name}={v!r}' for name, v in shown)})":
            return public
    if isinstance(value, tuple) and isinstance(getattr(kind, "_fields", None), tuple):
        # A namedtuple, where `repr` gives what `collections.namedtuple` writes: written by its
        # fields, so that a set in one is listed sorted.
        shown = list(zip(kind._fields, value))
        if repr(value) == f"{kind.__name__}({', '.join(f'{name}={v!r}' for name, v in shown)})":
            return shown
        return None
    if kind.__repr__ is not object.__repr__:
        return None
    attributes = dict(vars(value)) if isinstance(getattr(value, "__dict__", None), dict) else None
    # A class with `__slots__` keeps its attributes there, not in `__dict__`: read only the
    # latter and such an object entered the recipe by its type alone, whatever its settings.
    for slot in _slots(kind):
        held = getattr(value, slot, _UNSET)
        if held is not _UNSET:
            attributes = {} if attributes is None else attributes
            attributes.setdefault(slot, held)
    if attributes is None:
        return None
    return sorted(((str(k), v) for k, v in attributes.items() if not str(k).startswith("_")),
                  key=lambda item: item[0])


def _slots(kind: type) -> list[str]:
    """The public slot names `kind` and its bases declare (`__slots__` may be one string)."""
    names = []
    for cls in kind.__mro__:
        declared = cls.__dict__.get("__slots__", ())
        for name in (declared,) if isinstance(declared, str) else declared:
            if isinstance(name, str) and not name.startswith("_") and name not in names:
                names.append(name)
    return names


def _array_repr(array: np.ndarray) -> str:
    """An array by dtype, shape and the SHA-256 of its bytes in C order: its repr shows only its
    ends past 1,000 items and floats to 8 digits, so two arrays differing in the middle or in
    the ninth digit entered the recipe alike. Objects, records (whose padding bytes hold anything)
    and long doubles (likewise) are written item by item instead."""
    dtype = array.dtype
    name = type(array).__name__
    if dtype.hasobject or dtype.names or dtype.type in (np.longdouble, np.clongdouble):
        return f"{name}({_stable_repr(array.tolist())}, dtype={dtype!r}, shape={array.shape})"
    return f"{name}(dtype={dtype.str}, shape={array.shape}, sha256:{_digest_in_place(array)})"


_BULK_BYTES = 1 << 20
"""From this size an array is hashed by `hashlib` (OpenSSL, ~6x faster than `_sha256`'s built-in)."""


def _digest_in_place(array: np.ndarray) -> str:
    """The first 16 hex digits of the SHA-256 of an array's bytes in C order, read where they lie
    (a copy only where the array is not C-contiguous). `tobytes()` copied it whole: a map reading
    a module-level lookup table of a GiB had a second GiB allocated, twice per loader built, and
    hashed at the built-in SHA-256's ~285 MB/s. The digest is the same."""
    data = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    if data.nbytes < _BULK_BYTES:
        return sha256(data).hexdigest()[:16]
    import hashlib  # only a bulk array pays for loading OpenSSL (see `_sha256`)

    return hashlib.sha256(data).hexdigest()[:16]


def _is_tensor(value) -> bool:
    """Whether `value` is a torch tensor, without importing torch where nothing has."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _tensor_repr(tensor) -> str | None:
    """A torch tensor as an array is written (`_array_repr`), for the same reason: its repr
    elides past 1,000 items and rounds to 4 digits. Its bytes are read as uint8, which every
    dtype allows (bfloat16 has no NumPy form). None for a tensor without plain bytes (sparse,
    quantized, on the meta device): its repr is used."""
    import torch

    try:
        plain = tensor.detach().resolve_conj().resolve_neg().to("cpu").contiguous()
        data = plain.reshape(-1).view(torch.uint8).numpy()
    except (RuntimeError, TypeError, NotImplementedError):
        return None
    digest = _digest_in_place(data)
    return f"{type(tensor).__name__}(dtype={tensor.dtype}, shape={tuple(tensor.shape)}, sha256:{digest})"
