"""``kvpool/_native.pyi`` against the built ``kvpool._native``: the same classes, functions and
members, each callable with the same parameter names in the same order, the same
keyword-only marker and the same defaults as the Rust signature PyO3 publishes
(``__text_signature__``), and a constructor stubbed exactly where Rust has one. A method
added, removed or renamed in Rust without its stub fails here."""

import ast
import inspect
import os

import kvpool
import kvpool._native as native

STUB = os.path.join(os.path.dirname(kvpool.__file__), "_native.pyi")


def stub_tree():
    with open(STUB) as f:
        return ast.parse(f.read())


#: A default PyO3 does not spell out in ``__text_signature__`` (``Vec::new()``, …).
UNSPELT = object()


def params_of(fn: ast.FunctionDef):
    """(name, kind, default) of a stubbed callable's parameters, ``self`` / ``cls`` left out;
    the default is ``inspect.Parameter.empty`` when there is none, ``UNSPELT`` for ``...``."""
    args = fn.args
    positional = [*args.posonlyargs, *args.args]
    defaults = [inspect.Parameter.empty] * (len(positional) - len(args.defaults)) \
        + list(args.defaults)
    out = [(a.arg, "positional", d) for a, d in zip(positional, defaults)]
    out += [(a.arg, "keyword", inspect.Parameter.empty if d is None else d)
            for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    return [(name, kind, stub_default(d)) for name, kind, d in out
            if name not in ("self", "cls")]


def stub_default(node):
    if node is inspect.Parameter.empty:
        return node
    if isinstance(node, ast.Constant) and node.value is Ellipsis:
        return UNSPELT
    return ast.literal_eval(node)


def params_at_run_time(obj):
    """The same for the module's callable, from the signature PyO3 publishes."""
    sig = inspect.signature(obj)
    kinds = {inspect.Parameter.KEYWORD_ONLY: "keyword"}
    return [(name, kinds.get(p.kind, "positional"), p.default)
            for name, p in sig.parameters.items()
            if name not in ("self", "cls", "$self", "$cls")]


def assert_same_params(stub_fn, runtime_obj, what):
    """Names, order, kinds; a default on one side only, or two spelt defaults that differ,
    fail; a stub writes ``...`` exactly where PyO3 does not spell the default out."""
    stubbed, actual = params_of(stub_fn), params_at_run_time(runtime_obj)
    assert [p[:2] for p in stubbed] == [p[:2] for p in actual], what
    for (name, _, mine), (_, _, theirs) in zip(stubbed, actual):
        empty = inspect.Parameter.empty
        assert (mine is empty) == (theirs is empty), f"{what}: default of {name}"
        if mine is UNSPELT:
            assert theirs is Ellipsis, f"{what}: default of {name}: ... vs {theirs!r}"
        elif mine is not empty and theirs is not Ellipsis:
            assert mine == theirs, f"{what}: default of {name}: {mine!r} vs {theirs!r}"


def public(names):
    return {n for n in names if not n.startswith("_")}


def test_the_stub_names_what_the_module_exports():
    tree = stub_tree()
    stubbed = {n.name for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
    assert stubbed == public(dir(native))


def test_every_function_has_the_modules_parameters():
    for fn in (n for n in stub_tree().body if isinstance(n, ast.FunctionDef)):
        assert_same_params(fn, getattr(native, fn.name), fn.name)


def test_every_class_has_the_modules_members_and_parameters():
    for cls in (n for n in stub_tree().body if isinstance(n, ast.ClassDef)):
        runtime = getattr(native, cls.name)
        members = {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}
        assert public(members) == public(dir(runtime)), cls.name
        if "__new__" not in members:
            assert getattr(runtime, "__text_signature__", None) is None, \
                f"{cls.name} has a constructor in Rust the stub lacks"
        for name, fn in members.items():
            is_property = any(isinstance(d, ast.Name) and d.id == "property"
                              for d in fn.decorator_list)
            attr = inspect.getattr_static(runtime, name, None)
            if is_property:
                assert hasattr(attr, "__get__") and not callable(attr), f"{cls.name}.{name}"
                continue
            if name == "__new__":
                if getattr(runtime, "__text_signature__", None) is None:
                    # No constructor in Rust: Python refuses to make one.
                    raise AssertionError(f"{cls.name}.__new__ is stubbed but not exported")
                assert_same_params(fn, runtime, f"{cls.name}()")
                continue
            assert callable(attr), f"{cls.name}.{name}"
            assert_same_params(fn, getattr(runtime, name), f"{cls.name}.{name}")
