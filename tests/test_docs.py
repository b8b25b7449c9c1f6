"""The documentation against the code (CPU): every call signature docs/api.md writes out is the
function's own (inspect.signature: names, order and defaults), and every public function the
modules export has one there."""

import ast
import inspect
import re
from pathlib import Path

import pytest

import flash_cute
from flash_cute import distributed, trace
from flash_cute import flash_attn_interface as fa3

API = Path(__file__).resolve().parent.parent / "docs" / "api.md"
# A documented call: `name(parameters)` in backticks, over one or more lines.
CALL = re.compile(r"`(\w+)\(([^`]*?)\)`", re.DOTALL)
# Which module a section's calls belong to, by its heading.
SECTIONS = {
    "FlashAttention-3's interface": fa3,
    "Context parallelism": distributed,
    "Tracing": trace,
}
# Functions documented by prose rather than a signature of their own.
UNDOCUMENTED = {"empty_cache"}


def documented_calls():
    """(module, name, parameter text) of every documented call, by section."""
    module = flash_cute
    calls = []
    for section in re.split(r"^## ", API.read_text(), flags=re.MULTILINE):
        heading = section.split("\n", 1)[0].strip()
        module = SECTIONS.get(heading, flash_cute)
        for name, params in CALL.findall(section):
            if hasattr(module, name) and callable(getattr(module, name)):
                calls.append((module, name, " ".join(params.split())))
    return calls


CALLS = documented_calls()


def parameters(text: str):
    """[(name, default or inspect.Parameter.empty, keyword-only)] of a parameter list."""
    tree = ast.parse(f"def f({text}): pass").body[0].args
    names = [a.arg for a in tree.args]
    defaults = [inspect.Parameter.empty] * (len(names) - len(tree.defaults))
    defaults += [ast.literal_eval(d) for d in tree.defaults]
    result = [(n, d, False) for n, d in zip(names, defaults)]
    for arg, default in zip(tree.kwonlyargs, tree.kw_defaults):
        result.append((arg.arg, ast.literal_eval(default), True))
    return result


@pytest.mark.parametrize(
    "module, name, text", CALLS, ids=[f"{m.__name__}.{n}" for m, n, _ in CALLS]
)
def test_documented_signature_is_the_functions(module, name, text):
    documented = parameters(text)
    actual = [
        (p.name, p.default, p.kind is p.KEYWORD_ONLY)
        for p in inspect.signature(getattr(module, name)).parameters.values()
    ]
    assert documented == actual, f"docs/api.md's {name}{inspect.signature(getattr(module, name))}"


# (FlashAttention-3's functions keep its signatures: tests/test_fa3_interface.py pins them.)
@pytest.mark.parametrize("module", [flash_cute, distributed], ids=lambda m: m.__name__)
def test_every_public_function_is_documented(module):
    documented = {name for m, name, _ in CALLS if m is module}
    public = {
        name
        for name in getattr(module, "__all__", [])
        if inspect.isfunction(getattr(module, name)) and name not in UNDOCUMENTED
    }
    assert public <= documented, sorted(public - documented)
