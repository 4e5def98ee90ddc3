"""Nested pydantic models shared by tests/test_integrations_*.py: a tool whose argument
is a model inside a model (its JSON schema has $defs / $ref) and a structured reply
of the same shape."""
# (no "from __future__ import annotations": the frameworks read get_weather's annotations as types)

import json
from typing import Any, Literal

import jsonschema
from pydantic import BaseModel, Field

QUESTION = "What is the weather in Paris, France? Use celsius."
PERSON_PROMPT = "Invent a person who lives in Lyon, France. Reply in JSON."


class Location(BaseModel):
    city: str = Field(description="The city's name")
    country: str = Field(description="The country's name")


class WeatherQuery(BaseModel):
    """Get the current weather at a location."""
    location: Location
    unit: Literal["celsius", "fahrenheit"]


def get_weather(location: Location, unit: Literal["celsius", "fahrenheit"]) -> str:
    """Get the current weather at a location."""
    # (LlamaIndex passes the nested argument on as a dict)
    return f"21 degrees {unit} in {Location.model_validate(location).city}"


class Address(BaseModel):
    street: str
    city: str


class Person(BaseModel):
    name: str
    age: int
    address: Address


WEATHER_PARAMETERS = WeatherQuery.model_json_schema()   # has $defs (Location) and a $ref to it
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": WeatherQuery.__doc__,
                                                 "parameters": WEATHER_PARAMETERS}}


def check_weather_args(args: Any) -> WeatherQuery:
    """A get_weather call's arguments (a dict or JSON text) validate against the schema
    the model was given, and as the pydantic model."""
    if isinstance(args, str):
        args = json.loads(args)
    jsonschema.validate(args, WEATHER_PARAMETERS)
    return WeatherQuery.model_validate(args)
