"""A kernel's launch arguments as one record, declared once by its __call__'s signature."""

import inspect
from collections import namedtuple


def signature_record(name: str, method, optional: bool = False) -> type:
    """A NamedTuple class of method's parameters (self and the trailing stream aside), in
    order, with `of(locals())` building one from the method's locals; optional: every field
    defaults to None."""
    params = tuple(inspect.signature(method).parameters)
    assert params[0] == "self" and params[-1] == "stream", params
    fields = params[1:-1]
    base = namedtuple(name, fields, defaults=(None,) * len(fields) if optional else ())

    def of(cls, values: dict):
        """From the method's locals()."""
        return cls(**{field: values[field] for field in cls._fields})

    return type(name, (base,), {"__slots__": (), "of": classmethod(of)})
