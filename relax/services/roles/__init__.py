"""The roles of a run, each a plain class whose ``step()`` does one unit of work.

rollout (prompts -> engines -> rewards -> the ``rollouts`` topic), the column roles that add
fields to its rows (advantage, reward, reference, teacher, critic; :mod:`~relax.services.roles.column`),
and the actor (batches in, weights out). :mod:`~relax.services.roles.factory` names and builds them.
"""
