"""Team invitations by email: the only rows the web UI owns.

An invitation to an address that already belongs to a user makes the membership at once; any
other address gets a row here, and the membership is made when someone verifies that address
(``web.signals``). Verification is what proves ownership of the address, not sign-up.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models


class Invitation(models.Model):
    team = models.ForeignKey("accounts.Team", on_delete=models.CASCADE, related_name="invitations")
    email = models.EmailField()
    role = models.CharField(max_length=16, default="member")
    invited_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+"
    )
    created = models.DateTimeField(auto_now_add=True)
    accepted = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["team", "email"], name="invitation_team_email_unique")
        ]
        ordering = ["-created"]

    def __str__(self) -> str:
        return f"{self.email} -> {self.team}"
