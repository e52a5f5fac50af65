"""Users, teams, memberships, API keys and quotas."""
