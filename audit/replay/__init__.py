"""The replay model server: an OpenAI-compatible chat completions endpoint
that plays scenario files deterministically (SPEC §5). Start it with
``python manage.py replay_model_server``."""

from ..catalogue import bundled_scenario_names
from .scenarios import Scenario, ScenarioError, ToolCall, Turn, Usage, load_scenarios

__all__ = ["Scenario", "ScenarioError", "ToolCall", "Turn", "Usage", "bundled_scenario_names", "load_scenarios"]
