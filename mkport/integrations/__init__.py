"""Integrations of mkport serve with voice-agent frameworks (optional extras)."""
