"""What the tests share: tiny models, framework runners, independent references, checks."""
