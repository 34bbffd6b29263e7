"""Every public class and function of jaxdist's namespaces has a docstring with an example."""

import inspect

import pytest

import jaxdist
import jaxdist._src.coordinator
import jaxdist.cluster_resolver
import jaxdist.tpu

NAMESPACES = [jaxdist, jaxdist.cluster_resolver, jaxdist.coordinator, jaxdist.tpu]


def _public():
    for mod in NAMESPACES:
        for name in getattr(mod, "__all__", []):
            obj = getattr(mod, name)
            if inspect.isclass(obj) and issubclass(obj, BaseException):
                continue  # errors are documented by their message and where they are raised
            if inspect.isclass(obj) or inspect.isfunction(obj):
                yield f"{mod.__name__}.{name}", obj


@pytest.mark.parametrize("name,obj", list(_public()), ids=lambda v: v if isinstance(v, str) else "")
def test_public_api_has_docstring_with_example(name, obj):
    doc = inspect.getdoc(obj) or ""
    assert doc, f"{name} has no docstring"
    assert "Example" in doc, f"{name}'s docstring has no example"
