// Swagger UI for /docs, from the packaged copy the service serves (/docs/assets): no CDN, no
// inline script (the page's policy allows only 'self'), no call to the public spec validator.
"use strict";
window.addEventListener("load", () => {
  window.ui = SwaggerUIBundle({
    url: "/openapi.json",
    dom_id: "#swagger-ui",
    presets: [SwaggerUIBundle.presets.apis],
    layout: "BaseLayout",
    deepLinking: true,
    validatorUrl: null,
  });
});
