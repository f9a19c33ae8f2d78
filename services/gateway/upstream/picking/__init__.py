"""Endpoint picking as a pipeline of small parts fed plain inputs: filters drop
endpoints that must not get the request, weighted scorers rate the rest, and the
picker takes the best (ties at random). Pure: no I/O, the clock is passed in."""

from llmesh.gateway.upstream.picking.filters import FILTERS, OPTIONAL_FILTERS
from llmesh.gateway.upstream.picking.picker import EndpointPicker
from llmesh.gateway.upstream.picking.scorers import PRESETS, SCORERS
from llmesh.gateway.upstream.picking.types import Endpoint, PickInput

__all__ = ["FILTERS", "OPTIONAL_FILTERS", "PRESETS", "SCORERS", "Endpoint", "EndpointPicker", "PickInput"]
