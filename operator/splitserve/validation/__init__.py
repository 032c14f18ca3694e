"""Offline validation with the CRD's schema and CEL rules (what a cluster would reject)."""

from splitserve.validation.advice import object_advice, spec_advice, text_advice
from splitserve.validation.checker import Problem, load_documents, validate_object, validate_text, with_defaults

__all__ = [
    "Problem",
    "load_documents",
    "object_advice",
    "spec_advice",
    "text_advice",
    "validate_object",
    "validate_text",
    "with_defaults",
]
