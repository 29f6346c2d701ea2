"""``kvpool/_native.pyi`` against the built ``kvpool._native``: the same classes, functions and
members, each callable with the same parameter names in the same order and the same
keyword-only marker as the Rust signature PyO3 publishes (``__text_signature__``). A method
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


def params_of(fn: ast.FunctionDef):
    """(name, kind) of a stubbed callable's parameters, ``self`` / ``cls`` left out."""
    args = fn.args
    out = [(a.arg, "positional") for a in [*args.posonlyargs, *args.args]]
    out += [(a.arg, "keyword") for a in args.kwonlyargs]
    return [p for p in out if p[0] not in ("self", "cls")]


def params_at_run_time(obj):
    """The same for the module's callable, from the signature PyO3 publishes."""
    sig = inspect.signature(obj)
    kinds = {inspect.Parameter.KEYWORD_ONLY: "keyword"}
    return [(name, kinds.get(p.kind, "positional")) for name, p in sig.parameters.items()
            if name not in ("self", "cls", "$self", "$cls")]


def public(names):
    return {n for n in names if not n.startswith("_")}


def test_the_stub_names_what_the_module_exports():
    tree = stub_tree()
    stubbed = {n.name for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
    assert stubbed == public(dir(native))


def test_every_function_has_the_modules_parameters():
    for fn in (n for n in stub_tree().body if isinstance(n, ast.FunctionDef)):
        assert params_of(fn) == params_at_run_time(getattr(native, fn.name)), fn.name


def test_every_class_has_the_modules_members_and_parameters():
    for cls in (n for n in stub_tree().body if isinstance(n, ast.ClassDef)):
        runtime = getattr(native, cls.name)
        members = {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}
        assert public(members) == public(dir(runtime)), cls.name
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
                assert params_of(fn) == params_at_run_time(runtime), f"{cls.name}()"
                continue
            assert callable(attr), f"{cls.name}.{name}"
            assert params_of(fn) == params_at_run_time(getattr(runtime, name)), \
                f"{cls.name}.{name}"
