from django.urls import path

from . import views

app_name = "chat"

urlpatterns = [
    path("", views.chat_page, name="page"),
    path("login/", views.chat_login, name="login"),
    path("logout/", views.chat_logout, name="logout"),
]
